"""The figures of bench.vllm_connector's JSON line from a run's samples (summarize_run), the line of nulls of a run
without vLLM (null_result) and the human table (render_table). Pure: no engine, no platform; the tests feed it
samples (tests/bench/test_vllm_connector_bench.py). Not a benchmark of its own (`make bench` skips bench/_*.py).
"""

from __future__ import annotations

import statistics

from bench._vllm_engines import Run
from bench._vllm_mla import bytes_figures
from bench._vllm_workloads import LONG_FIGURES, long_table_lines, workload_figures

CONTENDERS = ("recompute", "kcaas_miss", "kcaas_warm", "hbm_warm", "lmcache_warm", "mooncake_warm")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing (or b is 0)."""
    return a / b if a is not None and b else None


def summarize(samples: list[dict]) -> dict:
    """p50, p90, mean and count of a contender's TTFTs, with the tokens it was served and asked."""
    ttft = [s["ttft_ms"] for s in samples]
    return {
        "p50": statistics.median(ttft),
        "p90": percentile(ttft, 90),
        "mean": statistics.fmean(ttft),
        "n": len(ttft),
        "cached_tokens": sum(s["cached_tokens"] for s in samples),
        "prompt_tokens": sum(s["prompt_tokens"] for s in samples),
    }


def null_result(reason: str, mode: str) -> dict:
    """The JSON line of a run that could not measure: every figure named, null, with the reason."""
    return {
        "bench": "vllm_connector",
        "mode": mode,
        "skipped": reason,
        "ttft_p50_ms": {name: None for name in CONTENDERS},
        "ttft_speedup_vs_recompute": None,
        "ttft_vs_hbm_hit": None,
        "external_hit_rate": None,
        "miss_overhead": None,
        "ttft_speedup_vs_lmcache": None,
        "ttft_vs_lmcache": None,
        "ttft_vs_vllm_offloading": None,
        "ttft_vs_mooncake_store": None,
        "lmcache_skipped": reason,
        **{name: None for name in LONG_FIGURES},
        **bytes_figures(),
        "mla_ttft_speedup_vs_recompute": None,
    }


def summarize_run(run: Run, cfg, results: dict) -> None:
    """The figures of the JSON line from the samples (`cfg`: the run's BenchConfig): p50/p90 per contender, the
    ratios, the hit rates, the second workload's figures."""
    summaries = {name: summarize(s) for name, s in run.samples.items() if s}
    results["ttft_summary"] = summaries
    results["ttft_ms_samples"] = {name: [round(x["ttft_ms"], 1) for x in s] for name, s in run.samples.items()}
    p50 = {name: (summaries[name]["p50"] if name in summaries else None) for name in CONTENDERS}
    lm = summaries.get("lmcache_warm")
    if lm is not None and not lm["cached_tokens"]:  # LMCache ran but served nothing: recompute under another name
        results["lmcache_uncached_ttft_p50_ms"] = lm["p50"]
        p50["lmcache_warm"] = None
    results["ttft_p50_ms"] = p50
    results["ttft_p90_ms"] = {name: s["p90"] for name, s in summaries.items()}
    results["ttft_speedup_vs_recompute"] = ratio(p50["recompute"], p50["kcaas_warm"])
    results["ttft_vs_hbm_hit"] = ratio(p50["kcaas_warm"], p50["hbm_warm"])
    results["ttft_vs_hbm_hit_paired_median"] = paired_median(run, "kcaas_warm", "hbm_warm")
    results.update(miss_overhead_figures(run, cfg, p50))
    results["ttft_speedup_vs_lmcache"] = ratio(p50["lmcache_warm"], p50["kcaas_warm"])
    # KCaaS's TTFT over each peer connector's on the same workload (null, with peers_skipped's reason, where none ran)
    results["ttft_vs_lmcache"] = ratio(p50["kcaas_warm"], p50["lmcache_warm"])
    results["ttft_vs_vllm_offloading"] = None
    results["ttft_vs_mooncake_store"] = ratio(p50["kcaas_warm"], p50["mooncake_warm"])
    results["ttft_vs_mooncake_store_paired_median"] = paired_median(run, "kcaas_warm", "mooncake_warm")
    hit = lambda name: summaries[name]["cached_tokens"] / summaries[name]["prompt_tokens"]  # noqa: E731
    results["external_hit_rate"] = hit("kcaas_warm") if "kcaas_warm" in summaries else None
    # the bound's own hit rate: whole vLLM blocks (the connector's: whole cache blocks, as fine or finer)
    results["hbm_hit_rate"] = hit("hbm_warm") if "hbm_warm" in summaries else None
    if "mooncake_warm" in summaries:
        results["mooncake_hit_rate"] = hit("mooncake_warm")
    if lm is not None:
        results["lmcache_hit_rate"] = lm["cached_tokens"] / lm["prompt_tokens"]
    lmcache_reason(run, p50, results)
    results.update(check_figures(run, cfg, summaries))
    results.update(workload_figures(run.samples))


def paired_median(run: Run, name: str, bound: str) -> float | None:
    """The median over rounds of name's TTFT / bound's (the same moment's load on both), or None."""
    pairs = [a["ttft_ms"] / b["ttft_ms"] for a, b in zip(run.samples.get(name, []), run.samples.get(bound, []))]
    return statistics.median(pairs) if pairs else None


def lmcache_reason(run: Run, p50: dict, results: dict) -> None:
    """results["lmcache_skipped"]: gone where LMCache served hits, else why it has no figure."""
    if p50["lmcache_warm"] is not None:
        results.pop("lmcache_skipped", None)
        return
    if "lmcache" in run.errors:
        results["lmcache_skipped"] = f"LMCache's engine failed: {run.errors['lmcache']}"[-2000:]
    results.setdefault("lmcache_skipped", "not run")


def miss_overhead_figures(run: Run, cfg, p50: dict) -> dict:
    """The miss engine ran only in wave 1: its overhead is against vLLM alone in the same rounds."""
    wave1 = [x["ttft_ms"] for x in run.samples.get("recompute", [])][: cfg.compute_requests]
    figures = {
        "miss_overhead": ratio(p50["kcaas_miss"], statistics.median(wave1) if wave1 else None),
        "miss_overhead_vs_all_recompute": ratio(p50["kcaas_miss"], p50["recompute"]),
    }
    pairs = [m["ttft_ms"] / r for m, r in zip(run.samples.get("kcaas_miss", []), wave1)]
    if pairs:  # round by round (the same moment's load on both): the median of kcaas_miss / recompute
        figures["miss_overhead_paired_median"] = statistics.median(pairs)
    return figures


def check_figures(run: Run, cfg, summaries: dict) -> dict:
    """recompute's p50 by wave, the miss prompts' cached tokens, the first-token agreement, the errors."""
    figures: dict = {}
    recompute = [x["ttft_ms"] for x in run.samples.get("recompute", [])]
    if len(recompute) > cfg.compute_requests:  # wave 1 (beside kcaas_miss) and wave 2 (beside kcaas_warm)
        figures["recompute_p50_ms_by_wave"] = {
            "1": statistics.median(recompute[: cfg.compute_requests]),
            "2": statistics.median(recompute[cfg.compute_requests :]),
        }
    miss = summaries.get("kcaas_miss")
    if miss is not None:
        figures["kcaas_miss_cached_tokens"] = miss["cached_tokens"]  # 0: every miss prompt really missed
    # The greedy first token with a connector against vLLM alone on the same prompts: loaded KV = computed KV.
    agreement = {}
    for name in ("kcaas_warm", "hbm_warm", "lmcache_warm", "mooncake_warm"):
        pairs = first_token_pairs(run.samples.get("recompute", []), cfg, run.samples.get(name, []))
        if pairs:
            agreement[name] = sum(a == b for a, b in pairs) / len(pairs)
    if agreement:
        figures["first_token_agreement"] = agreement
    if run.errors:
        figures["errors"] = run.errors
    return figures


def first_token_pairs(recompute: list[dict], cfg, warm: list[dict]) -> list[tuple[int, int]]:
    """(vLLM alone's first token, the connector's) for each shared prompt both ran: recompute ran shared[0..k) in
    wave 1, then shared[compute_requests % N], shared[(compute_requests + 1) % N], ... in wave 2."""
    n = cfg.num_requests
    pairs = []
    for index, sample in enumerate(recompute):
        i = index % n
        if i < len(warm):
            pairs.append((sample["first_token"], warm[i]["first_token"]))
    return pairs


def render_table(r: dict) -> str:
    """The human table printed before the JSON line."""
    p50, p90 = r["ttft_p50_ms"], r.get("ttft_p90_ms", {})
    fmt = lambda v: "-" if v is None else f"{v:9.1f}"  # noqa: E731
    n = {name: s["n"] for name, s in r.get("ttft_summary", {}).items()}
    lines = [
        f"bench.vllm_connector ({r['mode']}): {r['num_requests']} shared-prefix requests "
        f"({r['system_tokens']}-token "
        f"system prompt + {r['user_tokens']} user tokens), {r['model']}, vLLM {r.get('vllm_version')}, "
        f"{r['cpu_count']} cores",
        f"  {'contender':<14} {'TTFT p50 ms':>11} {'p90 ms':>9} {'n':>4}",
    ]
    for name in CONTENDERS:
        lines.append(f"  {name:<14} {fmt(p50.get(name)):>11} {fmt(p90.get(name)):>9} {n.get(name, '-'):>4}")
    g = lambda k: "-" if r.get(k) is None else f"{r[k]:.3f}"  # noqa: E731
    lines.append(
        f"  speedup vs recompute {g('ttft_speedup_vs_recompute')}x, vs LMCache {g('ttft_speedup_vs_lmcache')}x, "
        f"over the engine's own HBM hit {g('ttft_vs_hbm_hit')}x, over Mooncake Store {g('ttft_vs_mooncake_store')}x"
        f", miss overhead {g('miss_overhead')}x, external hit rate {g('external_hit_rate')}"
    )
    lines += long_table_lines(r)
    if "mla_bytes_per_token_vs_mha" in r:
        lines.append(
            f"  MLA: latent {r['mla_bytes_per_token_vs_mha']:.4f}x the bytes of per-head K/V (DeepSeek-V3 shapes); "
            f"tiny MLA model speedup vs recompute {g('mla_ttft_speedup_vs_recompute')}x, "
            f"hit rate {g('mla_external_hit_rate')}"
        )
    if r.get("lmcache_skipped"):
        lines.append(f"  LMCache: {r['lmcache_skipped'][:400]}")
    for name, error in r.get("errors", {}).items():
        lines.append(f"  error ({name}): {error.splitlines()[0][:300] if error else ''}")
    lines.append(
        f"  (load average {r['loadavg_1min_at_start']:.1f} -> {r['loadavg_1min_at_end']:.1f}: a shared, "
        f"noisy machine; contenders interleaved round by round, read the ratios)"
    )
    return "\n".join(lines)
