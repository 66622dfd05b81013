"""bench.vllm_connector's figures from samples (the engines' side runs in tests/e2e): the KCaaS engine against the
same engine's own HBM hit (p50 over p50, and paired round by round), the peers named with null where they do not
run, and a run without vLLM still naming every figure."""

from bench import vllm_connector
from bench._vllm_engines import Run


def sample(ms: float, cached: int = 0) -> dict:
    return {"ttft_ms": ms, "cached_tokens": cached, "prompt_tokens": 2050, "first_token": 7}


def test_the_upper_bound_and_the_peers_are_reported_side_by_side():
    run = Run(vllm_connector.QUICK, print)
    run.samples = {
        "recompute": [sample(3000.0)] * 8,
        "kcaas_miss": [sample(3100.0)] * 8,
        "kcaas_warm": [sample(600.0, 1920), sample(800.0, 1920), sample(700.0, 1920)],
        "hbm_warm": [sample(500.0, 1920), sample(400.0, 1920), sample(700.0, 1920)],
    }
    results: dict = {}
    vllm_connector.summarize_run(run, vllm_connector.QUICK, results)
    assert results["ttft_vs_hbm_hit"] == 700.0 / 500.0  # p50 over p50
    assert results["ttft_vs_hbm_hit_paired_median"] == 1.2  # median of 600/500, 800/400, 700/700
    assert results["hbm_hit_rate"] == results["external_hit_rate"] == 1920 / 2050
    assert results["ttft_speedup_vs_recompute"] == 3000.0 / 700.0
    assert results["ttft_vs_lmcache"] is None and results["ttft_vs_vllm_offloading"] is None
    assert results["first_token_agreement"] == {"kcaas_warm": 1.0, "hbm_warm": 1.0}


def test_a_run_without_vllm_names_every_figure_of_the_issue():
    nulls = vllm_connector.null_result("no vLLM here", "quick")
    for name in ("ttft_vs_hbm_hit", "ttft_speedup_vs_recompute", "miss_overhead", "ttft_vs_lmcache"):
        assert name in nulls and nulls[name] is None
    assert set(nulls["ttft_p50_ms"]) == set(vllm_connector.CONTENDERS)
