"""What a vLLM engine stores is KCaaS's canonical layout, proven against references outside the connector's round
trip (an engine reading its own saves back hides a consistent permutation):

- the CPU attention backend's own cache write (`cpu_attn_reshape_and_cache`, each ISA this machine has, three
  dtypes) read back through the layout the connector probes: exactly the K and V the kernel was given;
- the KV an engine saved equals, per layer, K and V, the KV transformers computes for the same model and tokens;
- saves of a 128-token-block engine load into a fresh engine with 32-token vLLM blocks (more of the prefix, in
  other blocks): its greedy tokens and logprobs are vLLM's alone at that block size;
- transformers (the HF connector) reads an engine's saves: its greedy tokens are transformers' alone;
- an engine reads the HF connector's saves: its greedy tokens and logprobs are vLLM's alone.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import transformers

from kcaas.connectors.hf import HFConnector
from kcaas.transformers_kv import kv_from_dynamic_cache
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    RUNNER,
    as_baseline,
    assert_same_as_baseline,
    baseline,
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
    vllm_models,
    vllm_processes,
    vllm_python,
    wait_cached,
)

pytestmark = [requires_vllm]

SEED = ["a_seed", "b_seed"]
FRESH = ["a_other", "b_other", "a_seed", "unrelated"]
# A KV element computed by vLLM and by transformers agrees to fp32 rounding (seen: ~5e-5 on this model); a token's
# K read in another order is off by the values' own size (seen: ~17).
KV_ATOL = 1e-3


def test_the_cpu_backends_own_writes_read_back_exactly_through_the_probed_layout():
    done = subprocess.run(
        [vllm_python(), str(RUNNER), "probe-layout"], env=runner_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cases = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 15 and {case["isa"] for case in cases} >= {"vec16"}
    wrong = [case for case in cases if not (case["probed_reads_k"] and case["probed_reads_v"])]
    assert not wrong, wrong


def hf_model(model_dir: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def transformers_kv(model, tokens: list[int]) -> torch.Tensor:
    """[layers, 2, tokens, kv_heads, head_dim]: the KV transformers computes for `tokens` (post-RoPE K, as cached)."""
    return kv_from_dynamic_cache(model(torch.tensor([tokens]), use_cache=True).cache)


@torch.no_grad()
def greedy(model, tokens: list[int], connector: HFConnector | None = None) -> list[int]:
    ids = torch.tensor([tokens])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    output = connector.generate(ids, **kwargs) if connector else model.generate(ids, **kwargs)
    sequences = output.sequences if connector else output
    return sequences[0, len(tokens) :].tolist()


@pytest.mark.django_db(transaction=True)
def test_engines_of_other_block_sizes_and_transformers_read_each_others_saves_exactly(
    live_server, pki, vllm_models, baseline, vllm_agent, tenants, vllm_processes
):
    model_dir = vllm_models["llama"]
    tenant = tenants()
    spec = engine_spec(model_dir, block_size=16)
    from_vllm, from_hf = tenant.attach("from-vllm", spec), tenant.attach("from-hf", spec)
    common = dict(role="kv_both", url=live_server.url, pki=pki)
    seeder = vllm_processes.start(
        connector_job(model_dir, prompts(*SEED), cache="from-vllm", **common), tenant.env(), "seed"
    )
    alone_32 = vllm_processes.start(engine_job(model_dir, prompts(*FRESH), block_size=32), runner_env(), "alone-32")
    fresh_32 = vllm_processes.start(
        connector_job(model_dir, prompts(*FRESH), cache="from-vllm", block_size=32, start_paused=True, **common),
        tenant.env(),
        "fresh-32",
    )
    reads_hf = vllm_processes.start(
        connector_job(model_dir, prompts(*FRESH), cache="from-hf", start_paused=True, **common), tenant.env(), "hf-read"
    )

    # transformers stores the seed prompts' KV into its own cache, whole 16-token blocks
    model = hf_model(model_dir)
    writer = HFConnector(model, tenant.data_plane(from_hf), read_only=False)
    with torch.no_grad():
        for name in SEED:
            writer.forward(torch.tensor([PROMPTS[name]]))

    assert seeder.message()["num_cached_tokens"] == [0, 0]
    vllm_saved = tenant.data_plane(from_vllm)
    wait_cached(vllm_saved, {"a_seed": 272, "b_seed": 400})  # whole 16-token cache blocks
    seeder.close()

    # 1. the bytes vLLM saved are the KV transformers computes for the same tokens
    for name, saved_tokens in (("a_seed", 272), ("b_seed", 400)):
        n, saved = vllm_saved.get(PROMPTS[name])
        assert n == saved_tokens
        expected = transformers_kv(model, PROMPTS[name][:n])
        error = (saved - expected).abs().amax(dim=(2, 3, 4))  # per layer, per K/V
        assert error.max() <= KV_ATOL, f"{name}: max |vLLM's saved KV - transformers'| per layer [K, V]: {error}"

    # 2. transformers reads vLLM's saves: a prefix it did not compute, the tokens of transformers alone
    reader = HFConnector(model, vllm_saved, read_only=True)
    for name in ("a_other", "b_other"):
        assert greedy(model, PROMPTS[name], reader) == greedy(model, PROMPTS[name]), name
        assert reader.last_reuse.num_cached_tokens == {"a_other": 256, "b_other": 300}[name]  # to the token

    # 3. an engine with 32-token vLLM blocks loads the 128-token engine's saves, to the cache's 16-token blocks
    # (288 of b_other: 9 blocks of 32; 272 of a_seed: 8 blocks of 32 and half of the ninth)
    expected_32 = alone_32.message()
    assert fresh_32.message() == {"ready": True}
    fresh_32.go()
    served_32 = fresh_32.message()
    assert served_32["num_cached_tokens"] == [256, 288, 272, 0]
    assert connector_stat(served_32, "loaded_tokens") == 256 + 288 + 272
    assert_same_as_baseline(served_32, FRESH, as_baseline(expected_32, FRESH))

    # 4. an engine loads what transformers saved
    assert reads_hf.message() == {"ready": True}
    reads_hf.go()
    served_hf = reads_hf.message()
    assert served_hf["num_cached_tokens"] == [256, 288, 272, 0]
    assert connector_stat(served_hf, "loaded_tokens") == 256 + 288 + 272
    assert_same_as_baseline(served_hf, FRESH, baseline["llama"])
