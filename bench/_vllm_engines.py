"""The engine-process side of bench.vllm_connector: the random-init Llama (ModelConfig, build_model, model_dir), the
vLLM engine a child process runs in vLLM's venv (make_llm, serve: `python -m bench.vllm_connector --build-model/--serve
...` re-enters here), and the orchestrator's handle on those processes (Engine, Run, interleave), with the engines'
environment (engine_env, omp_bind) and the interpreters (vllm_python, lmcache_python, probe). Imports only the
standard library at module level: vLLM, torch and transformers are imported inside the functions the engine's venv
runs. Not a benchmark of its own (`make bench` skips bench/_*.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    num_kv_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 32000
    max_position_embeddings: int = 16384  # room for the long-document workload (8k-16k tokens)
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4  # float32

    def key(self) -> str:
        return (
            f"llama-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}-kv{self.num_kv_heads}"
            f"-i{self.intermediate_size}-v{self.vocab_size}-p{self.max_position_embeddings}-s{self.seed}"
        )


# the in-tree peers by the job's mode (bench/_vllm_peers.py)
PEER_CONNECTORS = {"lmcache": "LMCacheConnectorV1", "mooncake": "MooncakeStoreConnector"}


# ---- the vLLM side (runs in vLLM's venv: `python -m bench.vllm_connector --build-model/--serve ...`) -----------------
def build_model(directory: str, model: ModelConfig) -> None:
    import torch
    import transformers

    torch.manual_seed(model.seed)
    config = transformers.LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        torch_dtype="float32",
    )
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
            kv_connector="KCaaSConnector",
            kv_connector_module_path="kcaas.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=job["extra_config"],
        )
    elif job["mode"] in PEER_CONNECTORS:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=PEER_CONNECTORS[job["mode"]],
            kv_role="kv_both",
            kv_connector_extra_config=job.get("extra_config") or {},
            kv_load_failure_policy="recompute",  # as the KCaaS connector sets it: a failed load is a miss
        )
    return LLM(
        model=job["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=job["max_model_len"],
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=job["mode"] == "hbm",  # the upper bound: a hit in the engine's own device memory
        seed=0,
        **{**kwargs, **job.get("llm_options", {})},  # e.g. the MLA phase's block size and custom ops
    )


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
            conn.send(
                {
                    "ttft_ms": ttft_ms,
                    "cached_tokens": request.num_cached_tokens or 0,
                    "prompt_tokens": len(prompt),
                    # none where the request failed (a connector's failed load under "fail"): counted as a mismatch
                    "first_token": (request.outputs[0].token_ids or [None])[0],
                }
            )
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
        self.proc = subprocess.Popen(
            [str(python), "-m", "bench.vllm_connector", "--serve", job_file, self.address],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
                raise EngineFailed(
                    f"{self.name} engine exited {self.proc.returncode} while starting; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise EngineFailed(
                    f"{self.name} engine did not start within {timeout:g} s; log tail:\n{self.log_tail()}"
                )
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


def model_cache_root() -> Path:
    """Where built models are kept between runs ($KCAAS_BENCH_CACHE, default ~/.cache/kcaas-bench)."""
    return Path(os.environ.get("KCAAS_BENCH_CACHE") or Path.home() / ".cache" / "kcaas-bench")


def model_dir(model: ModelConfig, python: Path, log) -> str:
    root = model_cache_root()
    directory = root / model.key()
    if not (directory / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        log(f"building the random-init model in {directory} ...")
        done = subprocess.run(
            [str(python), "-m", "bench.vllm_connector", "--build-model", str(directory), json.dumps(asdict(model))],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"building the model failed:\n{done.stderr[-3000:]}")
    return str(directory)


def omp_bind() -> str:
    """The same OpenMP binding for every engine: all cores but the last (kept for vLLM's frontends, the platform and
    the node). vLLM's own "auto" binding differs by contender: it reserves one core for the scheduler process, and one
    more when a KV connector is configured; on 2 cores that second reservation fails and the engine binds both cores,
    so a connector engine would prefill with twice the threads of vLLM alone. VLLM_CPU_OMP_THREADS_BIND overrides."""
    n = os.cpu_count() or 1
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ("nobind" if n < 2 else "0" if n == 2 else f"0-{n - 2}")


def engine_env(extra: dict | None = None) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": omp_bind(),
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.update(extra or {})
    return env


class Run:
    """The state of one benchmark run: samples per contender, the engines alive, the errors. `cfg` is the
    entry point's BenchConfig (its startup_timeout_s and request_timeout_s)."""

    def __init__(self, cfg, log):
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
