"""The MLA phase of bench.vllm_connector: latent KV's size against materialized per-head K/V, and the time to first
token of a fresh vLLM engine running an MLA model that loads a shared prefix from KCaaS against the same engine
recomputing it. Runs in the main venv after the Llama waves, on the same platform; its engines are
`python -m bench.vllm_connector --serve` processes like theirs (bench/_vllm_engines.py). Not a benchmark of its own
(`make bench` skips bench/_*.py).

Figures (added to bench.vllm_connector's JSON):
  mla_bytes_per_token_vs_mha     bytes per token a latent cache stores for a DeepSeek-V3-shaped spec (61 layers,
                                 kv_lora_rank 512 + qk_rope_head_dim 64, bf16: 61 x 1,152) over the same model's
                                 materialized per-head K/V (61 layers x 128 heads x (192 K + 128 V) x 2 bytes):
                                 ~0.014 (mha_bytes_per_token_over_mla: the inverse, ~71)
  mla_ttft_speedup_vs_recompute  vLLM alone's TTFT p50 / a fresh KCaaS engine's, on a random-init DeepSeek-V3-style
                                 model (8 dense MLA layers, hidden 768, 12 heads, latent 512 + 64, float32; vLLM's
                                 CPU_MLA backend, 16-token blocks), shared 1,000-token system prompt + 40-60 user
                                 tokens, requests one at a time and interleaved round by round
  mla_external_hit_rate, mla_first_token_agreement, mla_ttft_p50_ms: as their Llama namesakes.
vLLM's CPU MLA backend runs without vLLM's prefix caching and chunked prefill (its platform turns them off), so
every hit is the connector's. Both engines run vLLM's torch rotary embedding (`-rotary_embedding`: the CPU custom op
mis-rotates MLA's strided k_pe).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
from pathlib import Path

from bench._vllm_engines import Run, engine_env, interleave, model_cache_root

MLA_FINGERPRINT = "kcaas-bench-deepseek-v3-mla-8l-768h@seed0"
MLA_CACHE_NAME = "bench-vllm-mla"
MLA_BLOCK_SIZE = 16  # the CPU MLA backend's only block size
MLA_CACHE_BYTES = 256 << 20  # the MLA cache's device bytes (on the Llama cache's node)
MLA_MODEL = dict(  # DeepSeek-V3-style attention: the only latent width vLLM's CPU MLA kernel takes (512 + 64)
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=12,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    first_k_dense_replace=8,  # every layer dense: the bench measures attention's KV, not experts
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    num_nextn_predict_layers=0,
    vocab_size=32000,
    max_position_embeddings=4096,
    rope_scaling=None,
    tie_word_embeddings=False,
)
DEEPSEEK_V3 = dict(  # the attention shapes of deepseek-ai/DeepSeek-V3's config.json
    num_hidden_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    num_key_value_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    torch_dtype="bfloat16",
)
SYSTEM_TOKENS, USER_TOKENS = 1000, (40, 60)
MAX_MODEL_LEN = 1152  # the longest prompt (1,060 tokens) + room
LLM_OPTIONS = {
    "block_size": MLA_BLOCK_SIZE,
    "compilation_config": {"custom_ops": ["-rotary_embedding"]},
    "attention_backend": "CPU_MLA",  # named: on a CPU with AMX vLLM would pick AMX_MLA (bf16 weights only)
}
REQUESTS = {"quick": 8, "full": 16}


def materialized_kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """Bytes per token of an MLA model's per-head K (nope + rope) and V, as an engine without MLA caches them."""
    k = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return config["num_hidden_layers"] * config["num_attention_heads"] * (k + config["v_head_dim"]) * dtype_bytes


def bytes_figures() -> dict:
    """The latent spec's stored bytes per token against the materialized per-head K/V (DeepSeek-V3, bf16)."""
    from kcaas.spec import KVCacheSpec

    latent = KVCacheSpec.from_hf_config(DEEPSEEK_V3, model_fingerprint="deepseek-ai/DeepSeek-V3").kv_bytes_per_token
    mha = materialized_kv_bytes_per_token(DEEPSEEK_V3)
    return {
        "mla_bytes_per_token": latent,
        "mha_bytes_per_token": mha,
        "mla_bytes_per_token_vs_mha": latent / mha,
        "mha_bytes_per_token_over_mla": mha / latent,
    }


# ---- the vLLM side ---------------------------------------------------------------------------------------------------
def build_mla_model(directory: str, config: dict) -> None:
    """The random-init DeepSeek-V3-style model (seed 0, float32), saved to `directory` (vLLM's venv runs this)."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).to(torch.float32)
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    Path(tmp).rename(directory)


# ---- the orchestrator ------------------------------------------------------------------------------------------------
def mla_model_dir(python: Path, log) -> str:
    shape = (MLA_MODEL[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    key = "deepseek-v3-mla-" + "-".join(map(str, shape))
    directory = model_cache_root() / key
    if not (directory / "config.json").exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        log(f"building the random-init MLA model in {directory} ...")
        done = subprocess.run(
            [str(python), "-m", "bench.vllm_connector", "--build-mla-model", str(directory), json.dumps(MLA_MODEL)],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"building the MLA model failed:\n{done.stderr[-3000:]}")
    return str(directory)


def prompts(n: int, seed: int = 21) -> tuple[list[list[int]], list[int], list[int]]:
    """(the shared-prefix prompts, the seeding prompt, the warm-up prompt)."""
    rng = random.Random(seed)
    ids = lambda count: [rng.randrange(MLA_MODEL["vocab_size"]) for _ in range(count)]  # noqa: E731
    system = ids(SYSTEM_TOKENS)
    shared = [system + ids(rng.randint(*USER_TOKENS)) for _ in range(n)]
    return shared, system + ids(50), ids(300)


def spec_dict() -> dict:
    from kcaas.spec import KVCacheSpec

    return KVCacheSpec.latent(
        model_fingerprint=MLA_FINGERPRINT,
        num_layers=MLA_MODEL["num_hidden_layers"],
        kv_lora_rank=MLA_MODEL["kv_lora_rank"],
        qk_rope_head_dim=MLA_MODEL["qk_rope_head_dim"],
        block_size=MLA_BLOCK_SIZE,
        kv_dtype="float32",
    ).to_dict()


def mla_phase(b) -> None:
    """Adds the MLA figures to b.results: the bytes always; the TTFT ones where the platform is up (else why not)."""
    b.results.update(bytes_figures())
    b.results.update({"mla_ttft_speedup_vs_recompute": None, "mla_external_hit_rate": None})
    if b.platform is None:
        b.results["mla_skipped"] = "the KCaaS platform did not start (see errors)"
        return
    from bench._vllm_platform import attach_cache

    run = Run(b.cfg, b.log)
    n = REQUESTS[b.results["mode"]]
    shared, seed_prompt, warmup = prompts(n)
    try:
        _, cache = attach_cache(b.platform, spec_dict(), MLA_CACHE_BYTES, name=MLA_CACHE_NAME)
        base = {
            "model_dir": mla_model_dir(b.python, b.log),
            "max_model_len": MAX_MODEL_LEN,
            "warmup": [warmup],
            "llm_options": LLM_OPTIONS,
        }
        extra = {**b.kcaas_job[0]["extra_config"], "cache": cache.id, "model_fingerprint": MLA_FINGERPRINT}
        kcaas_job, kcaas_env = {**base, "mode": "kcaas", "extra_config": extra}, b.kcaas_job[1]
        run.start("mla_recompute", b.python, {**base, "mode": "none"}, engine_env(), b.workdir)
        run.start("mla_seed", b.python, kcaas_job, kcaas_env, b.workdir)
        run.wait_ready(b.results)
        run.ask("mla_seed", "mla_seed", seed_prompt)
        run.close("mla_seed")
        run.start("mla_warm", b.python, kcaas_job, kcaas_env, b.workdir)
        run.wait_ready(b.results)
        b.log(f"MLA: {n} rounds of shared-prefix prompts (recompute, kcaas_warm) ...")
        for i, prompt in enumerate(shared):
            interleave(run, i, [("mla_recompute", "recompute", prompt), ("mla_warm", "kcaas_warm", prompt)])
    except Exception as error:  # noqa: BLE001 - report it: the Llama figures stand
        run.errors["mla"] = f"{type(error).__name__}: {error}"[-3000:]
    finally:
        run.close_all()
    b.results.update(ttft_figures(run))


def ttft_figures(run: Run) -> dict:
    recompute, warm = run.samples.get("recompute", []), run.samples.get("kcaas_warm", [])
    p50 = {
        name: statistics.median(x["ttft_ms"] for x in s) if s else None
        for name, s in (("recompute", recompute), ("kcaas_warm", warm))
    }
    figures: dict = {"mla_ttft_p50_ms": p50, "mla_model": dict(MLA_MODEL), "mla_requests": len(warm)}
    if p50["recompute"] and p50["kcaas_warm"]:
        figures["mla_ttft_speedup_vs_recompute"] = p50["recompute"] / p50["kcaas_warm"]
    if warm:
        figures["mla_external_hit_rate"] = sum(x["cached_tokens"] for x in warm) / sum(x["prompt_tokens"] for x in warm)
        pairs = list(zip(recompute, warm))
        figures["mla_first_token_agreement"] = sum(a["first_token"] == w["first_token"] for a, w in pairs) / len(pairs)
    if run.errors:
        figures["mla_errors"] = run.errors
    return figures
