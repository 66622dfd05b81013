"""Every kernel compiles for sm_90 (H100/H200) with the ptxas bundled in triton, on any machine, GPU or not.

The interpreter (TRITON_INTERPRET=1, how the other tests run the kernels on CPU) executes kernels as numpy and
never compiles them, so it cannot catch a kernel the compiler rejects. This runs tests/kernels/compile_sm90.py
in a fresh interpreter with TRITON_INTERPRET unset (~15 s the first time, ~2 s from Triton's cache).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kcaas_kernels import HAS_TRITON

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_sm90"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
