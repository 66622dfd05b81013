"""SGLang's HiCache storage interface over a live KCaaS, for tests/e2e/test_sglang_*.py (the main venv's side; SGLang
runs in the SGLang venv's interpreter, KCAAS_SGLANG_PYTHON, through tests/e2e/sglang_runner.py: `make test` sets it and
builds that venv, elsewhere the tests skip saying so).

- `sglang_python()`: the interpreter, or skip;
- `run_sglang(job, api_key)`: one runner process to its end: its answers by step, or the failure with its stderr;
- `backend_extra(url, cache, pki)`: SGLang's extra config naming kcaas.connectors.sglang (the v1 zero-copy path);
- `mha_pool` / `mla_pool` / `mha_spec` / `mla_spec`: tiny host pools and the caches that match them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kcaas.spec import KVCacheSpec
from tests.e2e.vllm_support import runner_env

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("sglang_runner.py")
RUN_TIMEOUT = 240.0  # a runner's imports (torch, sglang: ~5 s alone, more while other tests run) and its steps
MODEL = "tiny/sglang-hicache-test"  # SGLang's model name: the caches' fingerprint
PAGE_SIZE = 4  # SGLang's page: twice the caches' 2-token blocks


def sglang_python() -> str:
    """The SGLang venv's interpreter, or skip (make test always sets KCAAS_SGLANG_PYTHON, so CI never skips)."""
    path = os.environ.get("KCAAS_SGLANG_PYTHON")
    if not path:
        pytest.skip("KCAAS_SGLANG_PYTHON is not set: `make sglang-venv` builds .venv-sglang, `make test` sets it")
    if not os.access(path, os.X_OK):
        pytest.fail(f"KCAAS_SGLANG_PYTHON={path} is not an executable (run `make sglang-venv`)")
    return path


def backend_extra(url: str, cache: str, pki, **more) -> dict:
    """--hicache-storage-backend-extra-config for kcaas.connectors.sglang (the key comes from KCAAS_API_KEY)."""
    return {
        "backend_name": "kcaas",
        "module_path": "kcaas.connectors.sglang",
        "class_name": "KCaaSHiCacheStorage",
        "interface_v1": 1,
        "kcaas_url": url,
        "cache": cache,
        "ca_file": pki["ca"],
        **more,
    }


def mha_pool(layout: str = "layer_first") -> dict:
    return {"kind": "mha", "layout": layout, "layer_num": 2, "page_size": PAGE_SIZE, "size": 8 * PAGE_SIZE,
            "dtype": "float32", "head_num": 2, "head_dim": 8}  # fmt: skip


def mla_pool(layout: str = "page_first") -> dict:
    return {"kind": "mla", "layout": layout, "layer_num": 2, "page_size": PAGE_SIZE, "size": 8 * PAGE_SIZE,
            "dtype": "float32", "kv_lora_rank": 8, "qk_rope_head_dim": 4}  # fmt: skip


def mha_spec() -> KVCacheSpec:
    return KVCacheSpec(model_fingerprint=MODEL, num_layers=2, num_kv_heads=2, head_dim=8, block_size=2,
                       kv_dtype="float32", storage_dtype="float32")  # fmt: skip


def mla_spec() -> KVCacheSpec:
    return KVCacheSpec.latent(model_fingerprint=MODEL, num_layers=2, kv_lora_rank=8, qk_rope_head_dim=4,
                              block_size=2, kv_dtype="float32")  # fmt: skip


def job(extra: dict, pool: dict, steps: list[dict], *, is_mla: bool = False, tp_rank: int = 0, tp_size: int = 1):
    storage = {"tp_rank": tp_rank, "tp_size": tp_size, "is_mla_model": is_mla, "model_name": MODEL}
    return {"storage": {**storage, "extra_config": extra}, "pool": pool, "steps": steps}


class RunnerFailed(AssertionError):
    """The runner exited non-zero; `stderr` holds what it said."""

    def __init__(self, returncode: int, stderr: str):
        super().__init__(f"sglang runner exited {returncode}; its stderr ends:\n{stderr[-4000:]}")
        self.returncode, self.stderr = returncode, stderr


def run_sglang(job: dict, api_key: str, timeout: float = RUN_TIMEOUT) -> list[dict]:
    """Run one job in a fresh SGLang process; its step answers in order. Raises: RunnerFailed."""
    done = subprocess.run(
        [sglang_python(), str(RUNNER)],
        input=json.dumps(job) + "\n",
        cwd=REPO,
        env=runner_env(api_key),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RunnerFailed(done.returncode, done.stderr)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1] == {"done": True}, done.stdout[-2000:] + done.stderr[-2000:]
    return lines[:-1]
