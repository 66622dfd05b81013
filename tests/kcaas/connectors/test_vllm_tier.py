"""KCaaSTier against vLLM's own tier interface, in the vLLM venv (KCAAS_VLLM_PYTHON; skipped without it): vLLM's
factory resolves the tier from its config entry, no abstract method is left, and the chunk geometry the tier
derives from vLLM's own TieringOffloadingSpec (tokens, KV bytes, layout namespace) is what vLLM's primary tier
holds. The I/O against a live node: tests/e2e/test_vllm_tier.py."""

from __future__ import annotations

import json
import subprocess

from tests.e2e.vllm_support import REPO, requires_vllm, runner_env, vllm_python

pytestmark = requires_vllm

PROBE = r"""
import json, uuid
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
    OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from kcaas.connectors.vllm_session import ConnectorSetupError
from kcaas.connectors.vllm_tier import KCaaSTier, chunk_geometry, tier_config

entry = {"type": "KCaaSTier", "module_path": "kcaas.connectors.vllm_tier", "kcaas_url": "http://x", "cache": "c"}
cls = SecondaryTierFactory.get_tier_class(entry)

def spec(blocks_per_chunk, world_size, bytes_per_block):
    parallel = OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
        dcp_size=1, data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=True)
    config = OffloadingConfig(groups=(OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 22},
        engine_id=f"probe-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig("m", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk), parallel=parallel)
    return OffloadingSpecFactory.create_spec(config)

geometries = {}
cases = {"one": (1, 1, 8192), "four_blocks": (4, 1, 8192), "tp2": (1, 2, 4096), "padded": (1, 1, 8000)}
for name, args in cases.items():
    s = spec(*args)
    manager = s.get_manager()
    view = manager.primary_tier.get_kv_memoryview()
    g = chunk_geometry(s, view)
    geometries[name] = {"tokens": g.tokens_per_chunk, "payload": g.payload_bytes, "slot": view.strides[0],
                        "namespace": g.namespace}
    manager.shutdown()
try:
    tier_config({"kcaas_url": "http://x", "cache": "c", "save": "sync"})
    refused = None
except ConnectorSetupError as exc:
    refused = str(exc)
print(json.dumps({"is_tier": issubclass(cls, SecondaryTierManager), "same": cls is KCaaSTier,
                  "abstract": sorted(KCaaSTier.__abstractmethods__), "geometries": geometries,
                  "refused": refused,
                  "config": tier_config({"kcaas_url": "http://x", "cache": "c", "io_timeout_s": 2}).io_timeout_s}))
"""


def probe() -> dict:
    done = subprocess.run(
        [vllm_python(), "-c", PROBE], cwd=REPO, env=runner_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_tier_against_vllms_own_interface_and_geometry():
    found = probe()
    assert found["is_tier"] and found["same"], "vLLM's factory resolves type + module_path to KCaaSTier"
    assert found["abstract"] == [], "every abstract method of SecondaryTierManager is implemented"
    g = found["geometries"]
    assert (g["one"]["tokens"], g["one"]["payload"]) == (16, 8192)
    assert (g["four_blocks"]["tokens"], g["four_blocks"]["payload"]) == (64, 4 * 8192)
    assert (g["tp2"]["tokens"], g["tp2"]["payload"]) == (16, 2 * 4096)  # both workers' copies in one chunk
    assert g["padded"]["payload"] == 8000 < g["padded"]["slot"], "the slot's padding is not stored"
    namespaces = {v["namespace"] for v in g.values()}
    assert len(namespaces) == 4, "chunks of another size, parallelism or payload never share pages"
    assert g["tp2"]["namespace"] != g["one"]["namespace"]
    assert found["refused"] and "unknown KCaaSTier keys ['save']" in found["refused"]
    assert found["config"] == 2.0
