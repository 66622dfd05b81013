"""A real vLLM engine running an MLA model (tiny random-init DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim 64,
vLLM's CPU_MLA backend, 16-token blocks) on the real service through KCaaSConnector, with a latent cache
(KVCacheSpec attention 'mla': one 576-wide row per token and layer, stored as one head of 288):

- the CPU MLA backend's own cache write (CPUMLAImpl.do_kv_cache_update, three dtypes) reads back exactly
  through the layout the connector probes from it (and through the latent view);
- exactness: one engine computes and saves prompts whose shared prefixes end on a block boundary (256 tokens) and
  inside a block (300); a fresh engine loads whole blocks of them (256, 288, 272), counted by vLLM as external
  hits, and its greedy tokens and logprobs are vLLM's alone;
- the rows the engine saved are the model's latent: kv_c_normed equal to transformers' for the same tokens, k_pe
  the same rotary values in vLLM's interleaved order (transformers keeps them de-interleaved);
- prefill/decode: a kv_producer (engine core and worker in their own processes) prefills with sync saves, a
  kv_consumer with a read-only token decodes: a single engine's tokens, nothing written;
- a cache whose spec is not the model's (per-head K/V for this MLA model, a latent of another rank) is refused at
  engine start with one message naming the field.

vLLM's CPU `rotary_embedding` custom op mis-rotates MLA's strided k_pe; the engines here run its torch version
(`custom_ops: ["-rotary_embedding"]`) so their latent is the model's (the comparison with transformers shows it).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import transformers

from kcaas.spec import KVCacheSpec
from kcaas.transformers_kv import kv_from_dynamic_cache
from tests.e2e.test_vllm_connector import refusal_reasons
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    RUNNER,
    as_baseline,
    assert_same_as_baseline,
    connector_job,
    connector_stat,
    engine_job,
    engine_spec,
    prompts,
    requires_vllm,
    runner_env,
    sampled_logprobs,
    tenants,
    vllm_agent,
    vllm_agent_launcher,
    vllm_processes,
    vllm_python,
    wait_cached,
)

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]

MLA_BLOCK = 16  # the CPU MLA backend's only block size
SEED = ["a_seed", "b_seed"]
SEED_SAVED = {"a_seed": 272, "b_seed": 400}  # whole 16-token blocks of 276 and 400 tokens
FRESH = ["a_other", "b_other", "a_seed", "unrelated"]
FRESH_HITS = [256, 288, 272, 0]  # whole blocks of the cached prefix (300 shared: 288), never the last token
# CPU_MLA named: on a CPU with AMX, vLLM would pick AMX_MLA (bf16 weights only, rows the connector refuses)
MLA_OPTIONS = dict(
    block_size=MLA_BLOCK, custom_ops=["-rotary_embedding"], kv_cache_memory_bytes=32 << 20, attention_backend="CPU_MLA"
)
KV_ATOL = 1e-3  # vLLM and transformers agree to fp32 rounding; a misplaced value is off by its own size (~1)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("vllm-mla") / "deepseek_v3")
    done = subprocess.run(
        [vllm_python(), str(RUNNER), "build-model", "--arch", "deepseek_v3", "--out", out],
        env=runner_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_cpu_mla_backends_own_writes_read_back_exactly_through_the_probed_layout():
    done = subprocess.run(
        [vllm_python(), str(RUNNER), "probe-mla-layout"], env=runner_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cases = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {case["dtype"] for case in cases} == {"float32", "bfloat16", "float16"}
    assert all(case["probed_reads_rows"] and case["view_reads_rows"] for case in cases), cases


def mla_spec(model_dir: str, **overrides) -> KVCacheSpec:
    return engine_spec(model_dir, block_size=MLA_BLOCK, **overrides)


@torch.no_grad()
def transformers_latent(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """[layers, tokens, 576]: kv_c_normed | k_pe as transformers caches them for `tokens`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kv = kv_from_dynamic_cache(model(torch.tensor([tokens]), use_cache=True).past_key_values, latent=True)
    return torch.cat([kv[:, 0, :, 0], kv[:, 1, :, 0]], dim=-1)


def test_a_fresh_mla_engine_loads_the_latent_prefix_exactly(
    live_server, pki, mla_model, vllm_agent, tenants, vllm_processes
):
    tenant = tenants()
    spec = mla_spec(mla_model)
    assert (spec.attention, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.head_dim) == ("mla", 512, 64, 288)
    cache = tenant.attach("latent", spec)
    common = dict(role="kv_both", url=live_server.url, cache="latent", pki=pki, **MLA_OPTIONS)
    alone = vllm_processes.start(engine_job(mla_model, prompts(*SEED, *FRESH), **MLA_OPTIONS), runner_env(), "alone")
    seeder = vllm_processes.start(connector_job(mla_model, prompts(*SEED), **common), tenant.env(), "seed")
    fresh = vllm_processes.start(
        connector_job(mla_model, prompts(*FRESH), start_paused=True, **common), tenant.env(), "fresh"
    )
    expected = as_baseline(alone.message(), [*SEED, *FRESH])

    seeded = seeder.message()
    assert seeded["num_cached_tokens"] == [0, 0]
    assert_same_as_baseline(seeded, SEED, expected)
    dp = tenant.data_plane(cache)
    wait_cached(dp, SEED_SAVED)  # its async saves landed
    seeder.close()

    assert fresh.message() == {"ready": True}
    fresh.go()
    served = fresh.message()
    assert served["num_cached_tokens"] == FRESH_HITS
    assert served["external_hits"] == {"queries": sum(map(len, prompts(*FRESH))), "hits": sum(FRESH_HITS)}
    assert connector_stat(served, "loaded_tokens") == sum(FRESH_HITS)  # loaded from the node, not recomputed
    assert connector_stat(served, "loaded_bytes") == sum(FRESH_HITS) * spec.kv_bytes_per_token
    assert connector_stat(served, "failed_tokens") == 0
    assert_same_as_baseline(served, FRESH, expected)

    # the rows vLLM saved are the model's latent, in vLLM's rotary order
    n, saved = dp.get(PROMPTS["a_seed"])
    assert n == SEED_SAVED["a_seed"]
    vllm_rows = torch.cat([saved[:, 0, :, 0], saved[:, 1, :, 0]], dim=-1)  # [layers, tokens, 576]
    hf_rows = transformers_latent(mla_model, PROMPTS["a_seed"][:n])
    rank = spec.kv_lora_rank
    torch.testing.assert_close(vllm_rows[..., :rank], hf_rows[..., :rank], atol=KV_ATOL, rtol=0)
    vllm_pe, hf_pe = vllm_rows[..., rank:], hf_rows[..., rank:]
    half = spec.qk_rope_head_dim // 2
    torch.testing.assert_close(vllm_pe[..., 0::2], hf_pe[..., :half], atol=KV_ATOL, rtol=0)
    torch.testing.assert_close(vllm_pe[..., 1::2], hf_pe[..., half:], atol=KV_ATOL, rtol=0)


def test_mla_prefill_on_a_producer_decode_on_a_read_only_consumer(
    live_server, pki, mla_model, vllm_agent, tenants, vllm_processes
):
    tenant = tenants()
    cache = tenant.attach("pd", mla_spec(mla_model))
    common = dict(url=live_server.url, cache="pd", pki=pki, **MLA_OPTIONS)
    decode = ["a_seed", "b_seed", "a_other", "b_other", "unrelated"]
    alone = vllm_processes.start(engine_job(mla_model, prompts(*decode), **MLA_OPTIONS), runner_env(), "alone")
    producer = vllm_processes.start(
        connector_job(mla_model, prompts(*SEED), role="kv_producer", max_tokens=1, multiprocess=True, **common),
        tenant.env(),
        "producer",
    )
    consumer = vllm_processes.start(
        connector_job(mla_model, prompts(*decode), role="kv_consumer", start_paused=True, **common),
        tenant.env(),
        "consumer",
    )
    expected = as_baseline(alone.message(), decode)

    prefilled = producer.message()
    assert_same_as_baseline(prefilled, SEED, expected, max_tokens=1)
    dp = tenant.data_plane(cache, access="read")
    assert {name: dp.lookup(PROMPTS[name]) for name in SEED} == SEED_SAVED  # sync saves: there on return
    producer.close()

    assert consumer.message() == {"ready": True}
    consumer.go()
    decoded = consumer.message()
    assert decoded["num_cached_tokens"] == [272, 384, 256, 288, 0]  # b_seed: 400 cached, the last token computed
    assert connector_stat(decoded, "loaded_tokens") == 272 + 384 + 256 + 288
    assert connector_stat(decoded, "saved_tokens") == 0
    assert_same_as_baseline(decoded, decode, expected)
    assert dp.lookup(PROMPTS["unrelated"]) == 0  # the consumer computed it and wrote nothing


def test_a_cache_of_another_layout_is_refused_at_engine_start(
    live_server, pki, mla_model, vllm_agent, tenants, vllm_processes
):
    tenant = tenants()
    spec = mla_spec(mla_model)
    per_head = KVCacheSpec(  # per-head K/V of this model's attention (4 heads of 96 for K: what MHA would keep)
        model_fingerprint=spec.model_fingerprint,
        num_layers=spec.num_layers,
        num_kv_heads=4,
        head_dim=96,
        block_size=MLA_BLOCK,
        kv_dtype="float32",
        storage_dtype="float32",
    )
    other_rank = KVCacheSpec.latent(
        model_fingerprint=spec.model_fingerprint,
        num_layers=spec.num_layers,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        block_size=MLA_BLOCK,
        kv_dtype="float32",
    )
    tenant.attach("per-head", per_head)
    tenant.attach("other-rank", other_rank)
    started = {
        name: vllm_processes.start(
            connector_job(
                mla_model, prompts("a_seed"), role="kv_both", url=live_server.url, cache=name, pki=pki, **MLA_OPTIONS
            ),
            tenant.env(),
            name,
        )
        for name in ("per-head", "other-rank")
    }
    for (name, process), phrase in zip(started.items(), ("attention", "kv_lora_rank")):
        status, stderr = process.failed_start()
        assert status != 0
        reasons = refusal_reasons(stderr)
        assert len(reasons) == 1, f"{name}: expected one reason, got {reasons}\n{stderr[-4000:]}"
        (reason,) = reasons
        assert phrase in reason, f"{name}: {reason!r} does not name {phrase!r}"
