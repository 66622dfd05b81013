"""vLLM's own TieringOffloadingManager with KCaaSTier, in the vLLM venv (KCAAS_VLLM_PYTHON), for
tests/e2e/test_vllm_tier.py. Never imported by the main venv's pytest (not test_*; it imports vLLM).

    $KCAAS_VLLM_PYTHON tests/e2e/vllm_tier_runner.py < job.json

The job (one JSON line): {"command": "store" | "load", "extra_config": {...}  # vLLM's
kv_connector_extra_config, secondary_tiers and all; "model", "dtype", "layers", "kv_heads", "head_dim",
"block_size", "keys": [hex], "seed", "kv_file": null, "out_file": null, "pause_after_lookup": false}.
`kv_file`: the chunks' KV back to back (else seeded random values); `out_file`: where `load` writes the loaded
chunks back to back, in key order.

The manager comes from vLLM's own factory (OffloadingSpecFactory: spec_name TieringOffloadingSpec, which builds the
CPU primary tier in /dev/shm and the tier from `secondary_tiers` by type + module_path). What no CPU build can run
is the GPU->CPU worker (CPUOffloadingSpec.get_worker refuses), so `store` writes each chunk's KV into the primary
slots vLLM gives it, as that worker would, then drives prepare_store / complete_store (which cascades to the tier)
and steps the scheduler's hook until no job is pending. `load` is a fresh manager: lookups (RETRY until the tier's
batched lookup answers, then HIT_PENDING while the promotion loads) until each key settles at HIT or MISS, then
prepare_load and the bytes of every HIT. Output: one JSON line (with `pause_after_lookup`, a first line after the
lookups, then it waits for a line on stdin).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid


def main() -> None:
    job = json.loads(sys.stdin.readline())
    manager = make_spec(job).get_manager()
    try:
        result = store(manager, job) if job["command"] == "store" else load(manager, job)
    finally:
        manager.shutdown()
    print(json.dumps(result), flush=True)


def make_spec(job: dict):
    """vLLM's spec from the job's kv_connector_extra_config, through vLLM's own factory."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    block = job["block_size"]
    layers = job["layers"]
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(block, tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)), 0),),
        worker_kv_bytes_per_block=layers * 2 * block * job["kv_heads"] * job["head_dim"] * 4,  # float32 K and V
        enable_kv_cache_events=False,
        extra_config=job["extra_config"],
        engine_id=f"kcaas-tier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=job["model"], dtype=job["dtype"]),
        cache=OffloadingCacheConfig(tokens_per_hash=block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return OffloadingSpecFactory.create_spec(config)


def store(manager, job: dict) -> dict:
    import numpy as np
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext

    slots = np.asarray(manager.primary_tier.get_kv_memoryview())
    keys = [OffloadKey(bytes.fromhex(k)) for k in job["keys"]]
    request = ReqContext(req_id="store")
    manager.on_new_request(request)
    prepared = manager.prepare_store(keys, request)
    payload = chunk_bytes(job)
    chunks = given_chunks(job, len(keys), payload)
    digests = {}
    for key, slot in zip(prepared.keys_to_store, prepared.store_spec.chunk_ids):
        slots[int(slot), :payload] = chunks[keys.index(key)]  # where the worker's GPU->CPU copy would write
        digests[key.hex()] = hashlib.sha256(slots[int(slot), :payload].tobytes()).hexdigest()
    manager.complete_store(prepared.keys_to_store, request)
    manager.on_request_finished(request)
    steps = step_until(manager, lambda: not manager.has_pending_work())
    stats = manager.get_stats()
    return {"digests": digests, "steps": steps, "stats": repr(stats.data if stats is not None else None)[:2000]}


def load(manager, job: dict) -> dict:
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

    keys = [OffloadKey(bytes.fromhex(k)) for k in job["keys"]]
    request = ReqContext(req_id="load")
    manager.on_new_request(request)
    first = {k.hex(): manager.lookup(k, request).name for k in keys}
    looked = settle(manager, keys, request, {LookupResult.RETRY})
    if job.get("pause_after_lookup"):
        print(json.dumps({"looked_up": looked}), flush=True)
        sys.stdin.readline()
    started = time.monotonic()
    final = settle(manager, keys, request, {LookupResult.RETRY, LookupResult.HIT_PENDING})
    load_s = time.monotonic() - started
    hits = [k for k in keys if final[k.hex()] == "HIT"]
    digests = {}
    if hits:
        slots = np.asarray(manager.primary_tier.get_kv_memoryview())
        payload = chunk_bytes(job)
        spec = manager.prepare_load(hits, request)
        loaded = [slots[int(slot), :payload].tobytes() for slot in spec.chunk_ids]  # what the worker would copy
        digests = {key.hex(): hashlib.sha256(chunk).hexdigest() for key, chunk in zip(hits, loaded)}
        if job.get("out_file"):
            with open(job["out_file"], "wb") as f:
                f.write(b"".join(loaded))
        manager.complete_load(hits, request)
    manager.on_request_finished(request)
    step_until(manager, lambda: not manager.has_pending_work())
    return {"first": first, "looked_up": looked, "final": final, "digests": digests, "load_s": load_s}


def chunk_bytes(job: dict) -> int:
    return job["layers"] * 2 * job["block_size"] * job["kv_heads"] * job["head_dim"] * 4  # float32 K and V


def given_chunks(job: dict, count: int, payload: int):
    """Each chunk's KV: the job's `kv_file` (chunks back to back), else seeded random float32 values."""
    import numpy as np

    if job.get("kv_file"):
        raw = np.fromfile(job["kv_file"], dtype=np.uint8)
        assert raw.size == count * payload, f"{job['kv_file']}: {raw.size} bytes, not {count} chunks of {payload}"
        return raw.reshape(count, payload)
    values = np.random.default_rng(job["seed"]).standard_normal(count * payload // 4, dtype=np.float32)
    return values.view(np.uint8).reshape(count, payload)


def settle(manager, keys, request, pending: set) -> dict[str, str]:
    """Step the scheduler's end-of-step hook until no key's lookup is in `pending`; each key's last answer."""
    answers: dict[str, str] = {}

    def settled() -> bool:
        manager.on_schedule_end(_step_end())
        answers.update({k.hex(): manager.lookup(k, request).name for k in keys})
        return not any(answers[k.hex()] in {p.name for p in pending} for k in keys)

    step_until(manager, settled)
    return answers


def step_until(manager, done, timeout: float = 60.0) -> int:
    """Call the scheduler's end-of-step hook until `done()` (a step every few ms, as an idle engine would)."""
    from tests.waiting import eventually

    steps = 0

    def step() -> bool:
        nonlocal steps
        steps += 1
        manager.on_schedule_end(_step_end())
        return done()

    if not eventually(step, timeout=timeout, interval=0.005):
        raise SystemExit(f"not settled after {timeout:g} s ({steps} steps)")
    return steps


def _step_end():
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
