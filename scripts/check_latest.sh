#!/usr/bin/env bash
# `make check-latest`: the newest releases pyproject.toml allows, installed into scratch venvs (never .venv or
# .venv-vllm), against a smoke subset that catches what a new upstream release breaks:
#   server venv: every room imported in one process beside transformers and Hugging Face's `kernels`, the SDK wheel's
#                names, the transformers connector's exactness tests, the engine's tests;
#   vLLM venv:   the connector's import against the newest vLLM the extra allows, and its spec and layout checks.
# It prints which releases differ from the locks and which step broke, and exits 1 if any did. It does not gate CI:
# a release must never turn `make test` red by itself; what it reports goes into a deliberate `make lock`.
# KCAAS_CHECK_DIR keeps the scratch venvs there (default: a fresh temporary directory, removed at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY_SYS=${PY_SYS:-python3.11}
SCRATCH=${KCAAS_CHECK_DIR:-$(mktemp -d)}
[ -n "${KCAAS_CHECK_DIR:-}" ] || trap 'rm -rf "$SCRATCH"' EXIT
mkdir -p "$SCRATCH"
REPORT="$SCRATCH/report.txt"
: >"$REPORT"
status=0

step() {  # step NAME COMMAND...: run, log to $SCRATCH/NAME.log, record PASS/FAIL; fails when the command did
    local name=$1
    shift
    echo "== $name"
    if "$@" >"$SCRATCH/$name.log" 2>&1; then
        echo "PASS $name" | tee -a "$REPORT"
        return 0
    fi
    echo "FAIL $name (log: $SCRATCH/$name.log)" | tee -a "$REPORT"
    tail -n 30 "$SCRATCH/$name.log" | sed 's/^/    /'
    status=1
    return 1
}

newer_than_lock() {  # newer_than_lock PYTHON LOCK: releases the scratch venv got that differ from the lock
    "$1" - "$2" <<'EOF' | tee -a "$REPORT"
import importlib.metadata, re, sys
from packaging.utils import canonicalize_name
locked = {}
for line in open(sys.argv[1]):
    if m := re.match(r"^([A-Za-z0-9_.\-]+)==(\S+?)\s*(;.*)?\\?$", line.strip()):
        locked[canonicalize_name(m.group(1))] = m.group(2).rstrip("\\").strip()
for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name = canonicalize_name(dist.metadata["Name"])
    if name != "kcaas" and locked.get(name) != dist.version:
        print(f"    {sys.argv[1]}: {name} {locked.get(name, '(not locked)')} -> {dist.version}")
EOF
}

server_venv() {
    "$PY_SYS" -m venv "$SCRATCH/server" &&
        "$SCRATCH/server/bin/python" -m pip install -q --upgrade pip setuptools &&
        "$SCRATCH/server/bin/python" -m pip install -q -e ".[control,node,gpu,dev,network,hf]" &&
        "$SCRATCH/server/bin/python" scripts/server_env.py
}

vllm_venv() {
    "$PY_SYS" -m venv "$SCRATCH/vllm" &&
        "$SCRATCH/vllm/bin/python" -m pip install -q --upgrade pip setuptools &&
        "$SCRATCH/vllm/bin/python" -m pip install -q torch==2.13.0 &&
        "$SCRATCH/vllm/bin/python" -m pip install -q -e ".[vllm]" pytest &&
        "$SCRATCH/vllm/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
}

server_smoke() {
    eval "$(scripts/services.sh)"
    DATABASE_URL="$DATABASE_URL" REDIS_URL=redis://127.0.0.1:6379/15 CELERY_BROKER_URL=redis://127.0.0.1:6379/14 \
        TRITON_INTERPRET=1 PYTHONNODEBUGRANGES=1 "$SCRATCH/server/bin/python" -m pytest -q -p no:cacheprovider \
        tests/test_install_names.py tests/test_layering.py \
        tests/e2e/test_tiny_llama_prefix_reuse.py tests/e2e/test_hf_connector.py \
        tests/e2e/test_hf_connector_sliding_window.py tests/kcaas/test_spec_from_hf_config.py \
        tests/gpu_node/engine tests/kernels
}

vllm_smoke() {
    (cd "$SCRATCH" && "$SCRATCH/vllm/bin/python" -c "
import kcaas, kcaas.connectors.vllm as connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
assert issubclass(connector.KCaaSConnector, KVConnectorBase_V1)
for name in ('gpu_node', 'kcaas_kernels', 'tenants', 'audit', 'bench'):
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(f'the engine environment can import the server room {name}')
print('connector imports against vLLM', __import__('vllm').__version__)
") || return 1
    # copies, away from tests/conftest.py (it imports Django, which an engine's environment does not have)
    mkdir -p "$SCRATCH/vllm-tests" && cp tests/kcaas/connectors/test_vllm_spec.py tests/kcaas/connectors/test_vllm_blocks.py "$SCRATCH/vllm-tests/"
    (cd "$SCRATCH/vllm-tests" && "$SCRATCH/vllm/bin/python" -m pytest -q -p no:cacheprovider .)
}

step server-install server_venv && { newer_than_lock "$SCRATCH/server/bin/python" locks/main.txt; step server-smoke server_smoke; }
step vllm-install vllm_venv && { newer_than_lock "$SCRATCH/vllm/bin/python" locks/vllm.txt; step vllm-smoke vllm_smoke; }

echo
echo "check-latest: $( [ $status -eq 0 ] && echo "nothing broke" || echo "something broke")"
cat "$REPORT"
exit $status
