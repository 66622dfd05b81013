"""bench.vllm_connector's figures from samples (the engines' side runs in tests/e2e): the KCaaS engine against the
same engine's own HBM hit (p50 over p50, and paired round by round), the peers named with null where they do not
run, the second workload (a long document, a multi-turn chat) paired by prompt, and a run without vLLM still naming
every figure."""

from bench import vllm_connector
from bench._vllm_engines import Run
from bench._vllm_workloads import make_long_prompts, workload_figures


def sample(ms: float, cached: int = 0, prompt_tokens: int = 2050, index: int | None = None) -> dict:
    s = {"ttft_ms": ms, "cached_tokens": cached, "prompt_tokens": prompt_tokens, "first_token": 7}
    return s if index is None else {**s, "prompt_index": index}


def test_the_upper_bound_and_the_peers_are_reported_side_by_side():
    run = Run(vllm_connector.QUICK, print)
    run.samples = {
        "recompute": [sample(3000.0)] * 8,
        "kcaas_miss": [sample(3100.0)] * 8,
        "kcaas_warm": [sample(600.0, 1920), sample(800.0, 1920), sample(700.0, 1920)],
        "hbm_warm": [sample(500.0, 1920), sample(400.0, 1920), sample(700.0, 1920)],
        "mooncake_warm": [sample(400.0, 1920), sample(400.0, 1920), sample(1400.0, 1920)],
    }
    results: dict = {}
    vllm_connector.summarize_run(run, vllm_connector.QUICK, results)
    assert results["ttft_vs_hbm_hit"] == 700.0 / 500.0  # p50 over p50
    assert results["ttft_vs_hbm_hit_paired_median"] == 1.2  # median of 600/500, 800/400, 700/700
    assert results["hbm_hit_rate"] == results["external_hit_rate"] == 1920 / 2050
    assert results["ttft_speedup_vs_recompute"] == 3000.0 / 700.0
    assert results["ttft_vs_lmcache"] is None and results["ttft_vs_vllm_offloading"] is None
    assert results["ttft_vs_mooncake_store"] == 700.0 / 400.0
    assert results["ttft_vs_mooncake_store_paired_median"] == 1.5  # median of 600/400, 800/400, 700/1400
    assert results["mooncake_hit_rate"] == 1920 / 2050
    assert results["first_token_agreement"] == {"kcaas_warm": 1.0, "hbm_warm": 1.0, "mooncake_warm": 1.0}


def test_the_second_workload_pairs_the_same_prompts():
    # long_doc: recompute ran questions 0 and 2 only; multi_turn: every turn from the second on
    samples = {
        "long_doc_kcaas": [sample(900.0, 8192, 8242, i) for i in range(4)],
        "long_doc_hbm": [sample(ms, 8192, 8242, i) for i, ms in enumerate((450.0, 900.0, 600.0, 300.0))],
        "long_doc_recompute": [sample(40000.0, 0, 8242, 0), {**sample(44000.0, 0, 8242, 2), "first_token": 8}],
        "multi_turn_kcaas": [sample(600.0, 896, 1250, 1), sample(800.0, 1152, 1500, 2)],
        "multi_turn_hbm": [sample(400.0, 896, 1250, 1), sample(400.0, 1152, 1500, 2)],
        "multi_turn_recompute": [sample(3000.0, 0, 1250, 1), sample(3400.0, 0, 1500, 2)],
    }
    f = workload_figures(samples)
    assert f["long_doc_ttft_vs_hbm_hit"] == 900.0 / 525.0  # p50 over p50 (hbm: the median of 4)
    assert f["long_doc_ttft_vs_hbm_hit_paired_median"] == 1.75  # median of 2, 1, 1.5, 3
    assert f["long_doc_ttft_speedup_vs_recompute"] == 42000.0 / 900.0
    assert f["long_doc_external_hit_rate"] == f["long_doc_hbm_hit_rate"] == 8192 / 8242
    assert f["long_doc_first_token_agreement"] == {"kcaas": 0.5, "hbm": 0.5}  # question 2's first token differs
    assert f["multi_turn_ttft_vs_hbm_hit"] == 700.0 / 400.0
    assert f["multi_turn_ttft_speedup_vs_recompute"] == 3200.0 / 700.0
    assert f["multi_turn_external_hit_rate"] == (896 + 1152) / (1250 + 1500)
    assert f["multi_turn_prompt_tokens"] == [1250, 1500]
    assert workload_figures({})["multi_turn_ttft_vs_hbm_hit"] is None  # not run: null


def test_each_turn_extends_the_last_and_every_prompt_fits_the_engines():
    for cfg in (vllm_connector.QUICK, vllm_connector.FULL):
        p = make_long_prompts(cfg, 32000)
        assert len(p.turns) == cfg.multi_turn_turns and len(p.turns[0]) == cfg.multi_turn_first_tokens
        for previous, turn in zip(p.turns, p.turns[1:]):
            assert turn[: len(previous)] == previous and len(turn) > len(previous) + cfg.multi_turn_answer_tokens
        doc = p.doc_seed[: cfg.long_doc_tokens]
        assert all(q[: cfg.long_doc_tokens] == doc for q in p.doc_questions)
        assert len({tuple(q[cfg.long_doc_tokens :]) for q in p.doc_questions}) == cfg.long_doc_questions
        longest = max(len(x) for x in [*p.turns, *p.doc_questions, p.doc_seed])
        assert longest < cfg.max_model_len <= vllm_connector.MODEL.max_position_embeddings
        assert cfg.max_model_len % vllm_connector.VLLM_BLOCK_SIZE == 0
    assert make_long_prompts(vllm_connector.QUICK, 32000) == make_long_prompts(vllm_connector.QUICK, 32000)


def test_a_run_without_vllm_names_every_figure_of_the_issue():
    nulls = vllm_connector.null_result("no vLLM here", "quick")
    for name in (
        "ttft_vs_hbm_hit",
        "ttft_speedup_vs_recompute",
        "miss_overhead",
        "ttft_vs_lmcache",
        "ttft_vs_mooncake_store",
        "long_doc_ttft_vs_hbm_hit",
        "long_doc_ttft_speedup_vs_recompute",
        "multi_turn_ttft_vs_hbm_hit",
        "multi_turn_ttft_speedup_vs_recompute",
    ):
        assert name in nulls and nulls[name] is None
    assert set(nulls["ttft_p50_ms"]) == set(vllm_connector.CONTENDERS)
