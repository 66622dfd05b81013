"""bench.named_pages runs end to end (one round: a node process, TLS 1.3, the vLLM bench's 45 MiB load as pages and as
one prefix, bytes checked before the clock) and reports every figure it promises, the engine figures it cannot
measure here as null with their reason."""

from bench.named_pages import NOT_RUN, PagesConfig, page_keys, run


def test_one_round_reports_both_paths_and_their_ratios():
    r = run(PagesConfig(rounds=1, warmup_rounds=0, ops_per_round=1), "test", 128)
    assert r["pages"] == 15 and r["tokens"] == 1920 and r["bytes"] == 1920 * 12 * 2 * 4 * 64 * 4
    for op in ("get", "put", "exists"):
        assert r[f"prefix_{op}_ms"] > 0 and r[f"named_{op}_ms"] > 0
        assert r[f"named_{op}_vs_prefix_{op}"] == round(r[f"named_{op}_ms"] / r[f"prefix_{op}_ms"], 3)
    for name, reason in NOT_RUN.items():
        assert r[name] is None and r[name.replace("_ttft_speedup_vs_recompute", "_not_run")] == reason


def test_page_keys_are_distinct():
    keys = page_keys(30)
    assert len(set(keys)) == 30 and all(len(key) == 64 for key in keys)
