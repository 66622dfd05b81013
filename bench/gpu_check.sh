#!/usr/bin/env bash
# Kernel checks for a lent CUDA machine (H200): the kernel test suite on CUDA (compiled Triton, no interpreter),
# then the full-size kernel benchmark and the quick engine benchmark. No network is assumed; finishes in about five minutes at most.
# Everything printed is also written under ${OUT:-/tmp}/: gpu_check.log, kernels-pytest.txt, kernels-junit.xml,
# bench-kernels.txt and bench-kernels.json (the benchmark's last line), bench-engine.txt and bench-engine.json.
#
# Python: $GPU_CHECK_PYTHON if set, else the first of python3 / python3.11 / python that imports torch (with CUDA) and triton; that is usually a
# system-wide CUDA build of torch, which a fresh venv would only replace with a download. Only when none does is a
# venv created (.venv-gpu) with the SDK and the extras' dependencies (pip install -e '.[node,gpu,dev]'); the server rooms
# come from the checkout on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1

has_cuda_stack() {
    "$1" -c 'import torch, triton; assert torch.cuda.is_available()' >/dev/null 2>&1
}

PY="${GPU_CHECK_PYTHON:-}"  # an explicit interpreter wins (also how the script is dry-run without a GPU)
[ -n "$PY" ] || for candidate in python3 python3.11 python; do
    if command -v "$candidate" >/dev/null 2>&1 && has_cuda_stack "$candidate"; then
        PY="$(command -v "$candidate")"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "== no python with torch+CUDA and triton: creating .venv-gpu and installing the project"
    BASE="$(command -v python3.11 || command -v python3)"
    "$BASE" -m venv .venv-gpu
    .venv-gpu/bin/python -m pip install -q -e '.[node,gpu,dev]'
    PY="$PWD/.venv-gpu/bin/python"
elif [ -z "${GPU_CHECK_PYTHON:-}" ] && ! "$PY" -c 'import pytest, hypothesis' >/dev/null 2>&1; then
    echo "== $PY has torch and triton but not pytest/hypothesis: a venv on top of its packages"
    "$PY" -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/python -m pip install -q 'pytest>=8' 'hypothesis>=6.100'
    PY="$PWD/.venv-gpu/bin/python"
fi

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")'

# Compiled Triton on the GPU: the interpreter must be off, and the CPU-interpreter test variants then skip.
unset TRITON_INTERPRET
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"  # the server rooms and kcaas_kernels (docs/ARCHITECTURE.md)

echo "== pytest tests/kernels (CUDA)"
status=0
timeout 210 "$PY" -m pytest -q -rs tests/kernels -p no:cacheprovider \
    --junitxml "$OUT_DIR/kernels-junit.xml" 2>&1 | tee "$OUT_DIR/kernels-pytest.txt" || status=$?

echo "== python -m bench.kernels (full size)"
timeout 120 "$PY" -m bench.kernels 2>&1 | tee "$OUT_DIR/bench-kernels.txt" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
tail -n 1 "$OUT_DIR/bench-kernels.txt" > "$OUT_DIR/bench-kernels.json" || true

echo "== python -m bench.engine --quick (the engine on CUDA: Triton write/read, Python planning)"
timeout 90 "$PY" -m bench.engine --quick 2>&1 | tee "$OUT_DIR/bench-engine.txt" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
tail -n 1 "$OUT_DIR/bench-engine.txt" > "$OUT_DIR/bench-engine.json" || true

echo "== done (exit status $status); outputs in $OUT_DIR"
exit "$status"
