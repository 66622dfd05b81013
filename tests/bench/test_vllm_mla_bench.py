"""bench/_vllm_mla.py's figures from their definitions: DeepSeek-V3's latent bytes against its per-head K/V, and the
TTFT ratios from samples (the engines themselves run in `python -m bench.vllm_connector`, not here)."""

from bench import vllm_connector
from bench._vllm_engines import Run
from bench._vllm_mla import DEEPSEEK_V3, bytes_figures, materialized_kv_bytes_per_token, ttft_figures


def test_the_latent_of_deepseek_v3_is_about_71_times_smaller_than_its_per_head_kv():
    figures = bytes_figures()
    assert figures["mla_bytes_per_token"] == 61 * (512 + 64) * 2  # one bf16 latent row per layer
    assert (
        figures["mha_bytes_per_token"]
        == 61 * 128 * (128 + 64 + 128) * 2
        == materialized_kv_bytes_per_token(DEEPSEEK_V3)
    )
    assert figures["mla_bytes_per_token_vs_mha"] == 1152 / 81920
    assert round(figures["mha_bytes_per_token_over_mla"], 1) == 71.1


def sample(ttft_ms: float, cached: int, first_token: int) -> dict:
    return {"ttft_ms": ttft_ms, "cached_tokens": cached, "prompt_tokens": 1050, "first_token": first_token}


def test_the_ttft_figures_compare_the_medians_of_the_same_rounds():
    run = Run(vllm_connector.QUICK, lambda message: None)
    run.samples["recompute"] = [sample(3000, 0, 7), sample(3200, 0, 8), sample(2900, 0, 9)]
    run.samples["kcaas_warm"] = [sample(600, 992, 7), sample(500, 992, 8), sample(700, 992, 1)]
    figures = ttft_figures(run)
    assert figures["mla_ttft_p50_ms"] == {"recompute": 3000, "kcaas_warm": 600}
    assert figures["mla_ttft_speedup_vs_recompute"] == 5.0
    assert figures["mla_external_hit_rate"] == 992 / 1050
    assert figures["mla_first_token_agreement"] == 2 / 3
    assert "mla_ttft_speedup_vs_recompute" not in ttft_figures(Run(vllm_connector.QUICK, print))  # no samples: none


def test_a_run_without_vllm_still_names_the_mla_figures():
    nulls = vllm_connector.null_result("no vLLM here", "quick")
    assert nulls["mla_ttft_speedup_vs_recompute"] is None
    assert nulls["mla_bytes_per_token_vs_mha"] == 1152 / 81920
