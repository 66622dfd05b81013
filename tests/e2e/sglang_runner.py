"""SGLang's HiCache storage interface driving kcaas.connectors.sglang, run by the SGLang venv's interpreter
(KCAAS_SGLANG_PYTHON, `make sglang-venv`); never imported by the main venv's pytest.

    $KCAAS_SGLANG_PYTHON tests/e2e/sglang_runner.py < job.json

The job (one JSON line on stdin):

    {"storage": {"tp_rank": 0, "tp_size": 1, "is_mla_model": false, "model_name": "...", "extra_config": {...}},
     "pool": {"kind": "mha" | "mla", "layout": "layer_first", "layer_num": 2, "page_size": 4, "size": 32,
              "dtype": "float32", "head_num": 2, "head_dim": 8} | {... "kv_lora_rank": 8, "qk_rope_head_dim": 4},
     "steps": [{"op": "fill", "seed": 1}, {"op": "set_v1", "keys": [...], "pages": [0, 1]}, ...]}

The backend is made as SGLang makes it: StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...),
pool), then register_mem_pool_host and on_host_pools_registered; the pool is tests/e2e/sglang_host_pool.py's
stand-in. Steps, each answered by one JSON line on stdout:

    fill {seed}                 -> {"digests": [sha256 of every page]}     random values in the whole pool
    zero                        -> {}                                      the pool all zero
    digest {pages}              -> {"digests": [...]}
    set_v1 / get_v1 {keys, pages} -> {"ok": [bool per page]}               batch_set_v1 / batch_get_v1
    set_flat {keys, pages}      -> {"ok": bool}                            batch_set of the pages' flat copies
    get_flat {keys}             -> {"digests": [sha256 or null]}           batch_get into fresh flat tensors
    exists {keys}               -> {"count": batch_exists, "each": [exists(key)]}
    stats                       -> get_stats()

The last line is {"done": true}. A failure exits 1 with the traceback on stderr.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def make_backend(job: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tests.e2e.sglang_host_pool import StandInHostPool

    s = job["storage"]
    config = HiCacheStorageConfig(
        tp_rank=s.get("tp_rank", 0),
        tp_size=s.get("tp_size", 1),
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=s.get("is_mla_model", False),
        enable_storage_metrics=False,
        is_page_first_layout=job["pool"]["layout"] != "layer_first",
        model_name=s.get("model_name"),
        extra_config=s["extra_config"],
    )
    pool = StandInHostPool(**job["pool"])
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend, pool


def indices(pool, pages):
    import torch

    return torch.cat([pool.page_slots(p) for p in pages]) if pages else torch.empty(0, dtype=torch.int64)


def run_step(backend, pool, step: dict) -> dict:
    import torch

    op = step["op"]
    if op == "fill":
        generator = torch.Generator().manual_seed(step["seed"])
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(pool.kv_buffer.dtype))
        return {"digests": [pool.page_digest(p) for p in range(pool.page_num)]}
    if op == "zero":
        pool.kv_buffer.zero_()
        return {}
    if op == "digest":
        return {"digests": [pool.page_digest(p) for p in step["pages"]]}
    if op == "set_v1":
        return {"ok": list(backend.batch_set_v1(step["keys"], indices(pool, step["pages"])))}
    if op == "get_v1":
        return {"ok": list(backend.batch_get_v1(step["keys"], indices(pool, step["pages"])))}
    if op == "set_flat":
        return {"ok": bool(backend.batch_set(step["keys"], [pool.flat_page(p) for p in step["pages"]]))}
    if op == "get_flat":
        targets = [torch.full_like(pool.flat_page(0), float("nan")) for _ in step["keys"]]
        got = backend.batch_get(step["keys"], targets)
        return {"digests": [None if t is None else _digest(t) for t in got]}
    if op == "exists":
        return {"count": backend.batch_exists(step["keys"]), "each": [backend.exists(k) for k in step["keys"]]}
    if op == "stats":
        return backend.get_stats()
    raise ValueError(f"unknown step {op!r}")


def _digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> int:
    job = json.loads(sys.stdin.readline())
    backend, pool = make_backend(job)
    try:
        for step in job["steps"]:
            started = time.monotonic()
            answer = run_step(backend, pool, step)
            answer["elapsed_s"] = round(time.monotonic() - started, 3)
            print(json.dumps({"op": step["op"], **answer}), flush=True)
    finally:
        backend.close()
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
