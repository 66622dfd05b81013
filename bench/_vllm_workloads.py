"""The second workload of bench.vllm_connector, measured in the same run as the shared-prefix chat and on the same
engines: a long document with distinct questions, and a multi-turn chat whose every turn extends the last. Each
against the same engine's own warm prefix cache (hbm, the upper bound) and vLLM alone recomputing (recompute). Not a
benchmark of its own (`make bench` skips bench/_*.py).

Prompts (make_long_prompts; token ids, one seed):
  long_doc     a document of long_doc_tokens (quick 8,192, full 12,288) + a distinct question of 40-60 tokens each
               (long_doc_questions: quick 4, full 8). The seeding prompt is the document + a question of its own.
  multi_turn   turn 1 = multi_turn_first_tokens (1,000); turn k = turn k-1's prompt + a simulated answer
               (multi_turn_answer_tokens, 200) + a new user message of 40-60 tokens; multi_turn_turns turns
               (quick 6, full 10), all the same for every contender.
Where each contender's prefix comes from (vLLM's prefix caching is off in the KCaaS engines, so a hit there can only
be the connector's; hbm hits whole 128-token blocks, vLLM's own grain, and KCaaS the cache's 16-token blocks: each as
fine as it can be, the rest recomputed):
  long_doc     kcaas_1 (wave 1's engine) computes the seeding prompt and saves it; in wave 3 kcaas_2, an engine that
               never saw the document, loads it from KCaaS for each question (long_doc_kcaas). hbm computes the same
               seeding prompt first (long_doc_hbm_seed), then hits the document in its own prefix cache
               (long_doc_hbm). vLLM alone recomputes every long_doc_recompute_every-th question, in the same rounds
               (long_doc_recompute: a full prefill of ~8k tokens is 40-75 s on one core).
  multi_turn   turn 1 runs on kcaas_3 (a third KCaaS engine, started for wave 3) and hbm (computed, saved or
               cached: multi_turn_*_first); from turn 2 on, each turn runs on the other KCaaS engine (kcaas_2,
               kcaas_3) than the turn before, so its prefix (the previous turn's prompt)
               is the one the other engine saved to KCaaS (multi_turn_kcaas); hbm hits the previous turn in its own
               prefix cache (multi_turn_hbm); vLLM alone recomputes every turn (multi_turn_recompute). The KCaaS
               engines save "sync": each turn's PUT of its new blocks is inside its TTFT.
Rounds interleave the contenders, the order alternating. Every sample carries the index of its prompt, so ratios
pair the same prompt.

Figures (added to the JSON line; null where a contender did not run):
  <w>_ttft_vs_hbm_hit                 KCaaS p50 / hbm p50, w in long_doc, multi_turn (1.0 is the bound), and
                                      <w>_ttft_vs_hbm_hit_paired_median (the median of per-prompt ratios)
  <w>_ttft_speedup_vs_recompute       recompute p50 / KCaaS p50 (long_doc: recompute on every other question)
  <w>_external_hit_rate, <w>_hbm_hit_rate   tokens served from KCaaS / from the engine's own cache over prompt tokens
  <w>_ttft_p50_ms, <w>_prompt_tokens, <w>_first_token_agreement (KCaaS's and hbm's greedy first token = vLLM alone's)
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from bench._vllm_engines import Run, engine_env

WORKLOADS = ("long_doc", "multi_turn")
LONG_FIGURES = tuple(f"{w}_{figure}" for w in WORKLOADS for figure in ("ttft_vs_hbm_hit", "ttft_speedup_vs_recompute"))
ROLES = ("kcaas", "hbm", "recompute")


@dataclass(frozen=True)
class LongPrompts:
    doc_seed: list[int]  # the document + a question none of doc_questions has (the seeding request)
    doc_questions: list[list[int]]  # the document + a distinct question each
    turns: list[list[int]]  # turn k = turns[k - 1] + a simulated answer + a new user message


def make_long_prompts(cfg, vocab: int, seed: int = 31) -> LongPrompts:
    """The second workload's prompts for a BenchConfig `cfg` (see the module docstring); the same for one seed."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    user = lambda: ids(rng.randint(cfg.user_tokens_min, cfg.user_tokens_max))  # noqa: E731
    doc = ids(cfg.long_doc_tokens)
    questions = [doc + user() for _ in range(cfg.long_doc_questions)]
    turns = [ids(cfg.multi_turn_first_tokens)]
    for _ in range(cfg.multi_turn_turns - 1):
        turns.append(turns[-1] + ids(cfg.multi_turn_answer_tokens) + user())
    return LongPrompts(doc_seed=doc + ids(50), doc_questions=questions, turns=turns)


def longest_prompt(cfg) -> int:
    """The longest prompt of the second workload (the engines' max_model_len must hold it)."""
    turns = cfg.multi_turn_first_tokens + (cfg.multi_turn_turns - 1) * (
        cfg.multi_turn_answer_tokens + cfg.user_tokens_max
    )
    return max(cfg.long_doc_tokens + cfg.user_tokens_max, turns)


def header(cfg, prompts: LongPrompts) -> dict:
    """The second workload's shape, for the JSON line's header."""
    return {
        "long_doc_tokens": cfg.long_doc_tokens,
        "long_doc_questions": cfg.long_doc_questions,
        "long_doc_recompute_every": cfg.long_doc_recompute_every,
        "multi_turn_turns": cfg.multi_turn_turns,
        "multi_turn_prompt_tokens": [len(t) for t in prompts.turns],
    }


# ---- the rounds (the orchestrator; `b` is bench.vllm_connector's Bench) ---------------------------------------------
def ask_round(run: Run, index: int, calls: list[tuple[str, str, list[int]]]) -> None:
    """One round: every (engine, contender, prompt) once, the order reversed on odd rounds; each answer is tagged
    with the round's prompt index."""
    for name, contender, prompt in calls if index % 2 == 0 else reversed(calls):
        answer = run.ask(name, contender, prompt)
        if answer is not None:
            answer["prompt_index"] = index


def seed_long_doc(b) -> None:
    """Wave 1's KCaaS engine (kcaas_1) computes the document's seeding prompt and saves it (save "sync")."""
    answer = b.run.ask("kcaas_1", "long_doc_kcaas_seed", b.long.doc_seed)
    if answer is not None:
        b.log(f"  long document seeded: {answer['prompt_tokens']} tokens, {answer['ttft_ms']:.0f} ms")


def wave3(b) -> None:
    """The long document, then the multi-turn chat, on wave 2's engines (kcaas_2, hbm, recompute) and a third KCaaS
    engine, kcaas_3 (started here, ready before the first round: at most four engines are alive at a time)."""
    run = b.run
    if "recompute" not in run.engines and "recompute" not in run.errors:  # closed for LMCache in wave 2
        run.start("recompute", b.python, {**b.base_job, "mode": "none"}, engine_env(), b.workdir)
    if b.kcaas_job and "kcaas_2" in run.engines:
        run.start("kcaas_3", b.python, b.kcaas_job[0], b.kcaas_job[1], b.workdir)
    run.wait_ready(b.results)
    p, cfg = b.long, b.cfg
    seeded = run.ask("hbm", "long_doc_hbm_seed", p.doc_seed)  # the document now in hbm's own prefix cache
    b.log(
        f"wave 3: a {cfg.long_doc_tokens}-token document, {len(p.doc_questions)} questions "
        f"(hbm seeded in {seeded['ttft_ms'] if seeded else float('nan'):.0f} ms) ..."
    )
    for i, prompt in enumerate(p.doc_questions):
        calls = [("kcaas_2", "long_doc_kcaas", prompt), ("hbm", "long_doc_hbm", prompt)]
        if i % cfg.long_doc_recompute_every == 0:
            calls.append(("recompute", "long_doc_recompute", prompt))
        ask_round(run, i, calls)
    b.log(f"wave 3: a {len(p.turns)}-turn chat ({len(p.turns[0])} to {len(p.turns[-1])} tokens) ...")
    ask_round(run, 0, [("kcaas_3", "multi_turn_kcaas_first", p.turns[0]), ("hbm", "multi_turn_hbm_first", p.turns[0])])
    for k in range(1, len(p.turns)):
        kcaas = "kcaas_2" if k % 2 else "kcaas_3"  # the other engine than the previous turn's: its prefix is KCaaS's
        calls = [(kcaas, "multi_turn_kcaas", p.turns[k]), ("hbm", "multi_turn_hbm", p.turns[k])]
        ask_round(run, k, [*calls, ("recompute", "multi_turn_recompute", p.turns[k])])


# ---- the figures --------------------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _by_prompt(samples: list[dict]) -> dict[int, dict]:
    return {s.get("prompt_index", i): s for i, s in enumerate(samples)}


def workload_figures(samples: dict[str, list[dict]]) -> dict:
    """The second workload's figures from a run's samples (see the module docstring)."""
    figures: dict = {}
    for w in WORKLOADS:
        figures.update(_figures_of(w, samples))
    return figures


def _figures_of(w: str, samples: dict[str, list[dict]]) -> dict:
    """One workload's figures (w: long_doc or multi_turn): p50s, ratios, hit rates, first-token agreement."""
    figures: dict = {}
    got = {role: samples.get(f"{w}_{role}", []) for role in ROLES}
    p50 = {role: statistics.median(s["ttft_ms"] for s in got[role]) if got[role] else None for role in ROLES}
    figures[f"{w}_ttft_p50_ms"] = p50
    figures[f"{w}_ttft_vs_hbm_hit"] = _ratio(p50["kcaas"], p50["hbm"])
    figures[f"{w}_ttft_speedup_vs_recompute"] = _ratio(p50["recompute"], p50["kcaas"])
    kcaas, hbm, recompute = (_by_prompt(got[role]) for role in ROLES)
    pairs = [kcaas[i]["ttft_ms"] / hbm[i]["ttft_ms"] for i in kcaas if i in hbm]
    figures[f"{w}_ttft_vs_hbm_hit_paired_median"] = statistics.median(pairs) if pairs else None
    for role, name in (("kcaas", "external_hit_rate"), ("hbm", "hbm_hit_rate")):
        s = got[role]
        figures[f"{w}_{name}"] = sum(x["cached_tokens"] for x in s) / sum(x["prompt_tokens"] for x in s) if s else None
    figures[f"{w}_prompt_tokens"] = [s["prompt_tokens"] for s in got["kcaas"] or got["hbm"]]
    agreement = {}
    for role, by in (("kcaas", kcaas), ("hbm", hbm)):
        same = [by[i]["first_token"] == r["first_token"] for i, r in recompute.items() if i in by]
        if same:
            agreement[role] = sum(same) / len(same)
    figures[f"{w}_first_token_agreement"] = agreement or None
    return figures


def long_table_lines(r: dict) -> list[str]:
    """The second workload's lines of the human table."""
    g = lambda k: "-" if r.get(k) is None else f"{r[k]:.3f}"  # noqa: E731
    lines = []
    for w, what in (("long_doc", f"{r.get('long_doc_tokens')}-token document"), ("multi_turn", "multi-turn chat")):
        p50 = {k: ("-" if v is None else f"{v:.0f}") for k, v in (r.get(f"{w}_ttft_p50_ms") or {}).items()}
        lines.append(
            f"  {what}: TTFT p50 ms kcaas {p50.get('kcaas', '-')}, hbm {p50.get('hbm', '-')}, recompute "
            f"{p50.get('recompute', '-')}; over the HBM hit {g(f'{w}_ttft_vs_hbm_hit')}x, speedup vs recompute "
            f"{g(f'{w}_ttft_speedup_vs_recompute')}x, hit rate {g(f'{w}_external_hit_rate')} "
            f"(hbm {g(f'{w}_hbm_hit_rate')})"
        )
    return lines
