"""Real vLLM engines over KCaaS, for tests/e2e/test_vllm_*.py (the main venv's side; vLLM itself runs in the vLLM
venv's interpreter, KCAAS_VLLM_PYTHON, through tests/e2e/vllm_runner.py: `make test` sets it and builds that venv,
elsewhere the tests skip saying so).

- `vllm_models` (session): two tiny random-init models built by the runner, {"llama": dir, "qwen2": dir};
- `PROMPTS` and `baseline` (session): prompt families sharing 256- and 300-token prefixes, and what each model
  generates for them with no connector at all (one engine per model, both at once);
- `VllmProcess` / `run_vllm(job, env)`: one runner process (stdout: its JSON lines; stderr: a file, quoted when it
  fails); `connector_job(...)`: a job with kcaas.connectors.vllm.KCaaSConnector;
- `vllm_agent_launcher` / `vllm_agent`: node agent processes (tests/e2e/conftest.AgentLauncher) with room for
  vLLM's 128-token blocks; `Tenant`: a tenant's key, SDK client, caches and data-plane clients.

Engines start in ~20-40 s here, so the tests start few and start them concurrently where the story allows
(an engine can start paused, `start_paused`, and be told to run once the cache holds what it should find).
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import kcaas
from kcaas.connectors.vllm_spec import spec_from_hf_config
from kcaas.dataplane import DataPlaneClient
from kcaas.spec import KVCacheSpec
from kcaas.tokens import TokenSource
from tests.caches.conftest import free_port
from tests.e2e.conftest import AgentLauncher, client_tls, tenant_key
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_runner.py")
VLLM_BLOCK = 128  # vLLM's KV block size on CPU: loads and saves move whole blocks of it
START_TIMEOUT = 300.0  # an engine's start (imports ~15 s, more while other engines start on these 2 cores) + a round
NODE_DEVICE_BYTES = 64 << 20
CACHE_DEVICE_BYTES = 8 << 20  # 8192 tokens of the tiny models' KV (1 KiB a token)
LOGPROB_ATOL = 1e-3  # a prefix computed in another batch agrees to fp32 rounding (~1e-5); a wrong one is off by ~0.1+


def vllm_python() -> str:
    """The vLLM venv's interpreter, or skip (make test always sets KCAAS_VLLM_PYTHON, so CI never skips)."""
    path = os.environ.get("KCAAS_VLLM_PYTHON")
    if not path:
        pytest.skip("KCAAS_VLLM_PYTHON is not set: `make vllm-venv` builds .venv-vllm, `make test` sets it")
    if not os.access(path, os.X_OK):
        pytest.skip(f"KCAAS_VLLM_PYTHON={path} is not an executable (run `make vllm-venv`)")
    return path


requires_vllm = pytest.mark.skipif(
    not (os.environ.get("KCAAS_VLLM_PYTHON") and os.access(os.environ["KCAAS_VLLM_PYTHON"], os.X_OK)),
    reason="KCAAS_VLLM_PYTHON is not set or not executable: `make vllm-venv` builds .venv-vllm, `make test` sets it",
)


def runner_env(api_key: str | None = None, **extra: str) -> dict[str, str]:
    """The runner's environment: this one without Django's or Triton's switches, offline, the repo importable
    (kcaas and tests.e2e.vllm_faulty_connector), the tenant's key in KCAAS_API_KEY when given."""
    drop = {"DJANGO_SETTINGS_MODULE", "TRITON_INTERPRET", "KCAAS_API_KEY", "KCAAS_URL"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if api_key is not None:
        env["KCAAS_API_KEY"] = api_key
    env.update(extra)
    return env


# ---- runner processes ------------------------------------------------------------------------------------------------


class VllmProcess:
    """One `vllm_runner.py generate` process (or another runner script of the vLLM venv: `args`): the job on its
    first stdin line, its JSON lines read with deadlines
    (a reader thread), stderr to a file. Its own process group, killed at `close()` if still there."""

    def __init__(self, job: dict, env: dict[str, str], workdir: Path, name: str, args: list[str] | None = None):
        self.name = name
        self.stderr_path = Path(workdir) / f"vllm-{name}.stderr"
        self._stderr = open(self.stderr_path, "w+")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [vllm_python(), *(args or [str(RUNNER), "generate"])],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,
        )
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def failure(self, what: str) -> str:
        return f"vLLM runner {self.name!r}: {what}; its stderr ends:\n{self.stderr[-6000:]}"

    def message(self, timeout: float = START_TIMEOUT) -> dict:
        """The runner's next JSON line (fails the test, quoting its stderr, on exit or timeout)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            pytest.fail(self.failure(f"no answer within {timeout:g} s"))
        if line is None:
            self.process.wait(timeout=30)
            pytest.fail(self.failure(f"exited with {self.process.returncode} before answering"))
        return json.loads(line)

    def go(self) -> None:
        """Start the next round (after `ready` or a round's result, with start_paused / pause_between_rounds)."""
        self.process.stdin.write("next\n")
        self.process.stdin.flush()

    def close(self, timeout: float = 30.0) -> int | None:
        """Let it exit (stdin closed), killing its group if it does not; its return code."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # whatever is left of its group (an engine core or worker the runner's exit orphaned)
        self._stderr.close()
        return self.process.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group this process leads: its engine core and workers
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=30)

    def failed_start(self, timeout: float = START_TIMEOUT) -> tuple[int, str]:
        """For an engine that must refuse to start: (exit status, stderr); fails if it answered or hung."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            pytest.fail(self.failure(f"still running after {timeout:g} s (it should have refused to start)"))
        assert line is None, self.failure(f"started and answered {line[:300]!r} (it should have refused to start)")
        self.process.wait(timeout=30)
        self._stderr.flush()
        return self.process.returncode, self.stderr


class VllmProcesses:
    """The runners a test started (`start`), every one closed at teardown (`vllm_processes` fixture)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: list[VllmProcess] = []

    def start(self, job: dict, env: dict[str, str], name: str) -> VllmProcess:
        process = VllmProcess(job, env, self.workdir, name)
        self.started.append(process)
        return process

    def run(self, job: dict, env: dict[str, str], name: str, timeout: float = START_TIMEOUT) -> dict:
        """One job to its end: the last round's result."""
        process = self.start(job, env, name)
        try:
            result = None
            while result is None or "round" in result:
                result = process.message(timeout)
            return result
        finally:
            process.close()

    def close(self) -> None:
        for process in self.started:
            if process.process.poll() is None:
                process.close(timeout=5)


@pytest.fixture
def vllm_processes(tmp_path):
    processes = VllmProcesses(tmp_path)
    try:
        yield processes
    finally:
        processes.close()


def run_vllm(job: dict, env: dict[str, str], workdir: Path, name: str = "run", timeout: float = START_TIMEOUT):
    processes = VllmProcesses(workdir)
    try:
        return processes.run(job, env, name, timeout)
    finally:
        processes.close()


def engine_job(model_dir: str, prompts: list[list[int]], *, max_tokens: int = 8, **options) -> dict:
    """A job without a connector (options: the runner's, e.g. multiprocess, rounds, start_paused)."""
    job = {
        "model": model_dir,
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_role": None,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "logprobs": 0,
        "multiprocess": False,
        "kv_cache_memory_bytes": 64 << 20,
    }
    job.update(options)
    return job


def connector_job(
    model_dir: str,
    prompts: list[list[int]],
    *,
    role: str,
    url: str,
    cache: str,
    pki,
    extra: dict | None = None,
    **options,
) -> dict:
    """A job with KCaaSConnector: the cache by name, the agent's dev CA, the key in KCAAS_API_KEY (runner_env)."""
    config = {"kcaas_url": url, "cache": cache, "ca_file": pki["ca"], **(extra or {})}
    return engine_job(model_dir, prompts, kv_role=role, extra_config=config, **options)


# ---- models, prompts and what vLLM alone makes of them ---------------------------------------------------------------


_built: dict[str, object] = {}  # session fixtures' values: each test module that imports a fixture registers its own
# copy of it (pytest binds fixtures to the module they are found in), so a "session" fixture would run per module


def _once(name: str, make):
    if name not in _built:
        _built[name] = make()
    return _built[name]


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict[str, str]:
    return _once("models", lambda: _build_models(tmp_path_factory))


def _build_models(tmp_path_factory) -> dict[str, str]:
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-models")
    built = {arch: str(root / arch) for arch in ("llama", "qwen2")}
    procs = {
        arch: subprocess.Popen(
            [python, str(RUNNER), "build-model", "--arch", arch, "--out", out],
            cwd=REPO,
            env=runner_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch, out in built.items()
    }
    for arch, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"building the tiny {arch} failed:\n{err[-4000:]}"
    return built


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


SHARED_256 = _tokens(256, seed=101)  # ends on a vLLM block boundary
SHARED_300 = _tokens(300, seed=102)  # ends inside vLLM's third block
PROMPTS = {
    "a_seed": SHARED_256 + _tokens(20, seed=1),  # 276 tokens: two whole blocks saved
    "b_seed": SHARED_300 + _tokens(100, seed=2),  # 400 tokens: three whole blocks saved (the third past the share)
    "a_other": SHARED_256 + _tokens(30, seed=3),  # after a_seed: 256 tokens loadable
    "b_other": SHARED_300 + _tokens(50, seed=4),  # after b_seed: 300 shared, 256 loadable (never the third block)
    "unrelated": _tokens(200, seed=5),  # nothing cached
}


def prompts(*names: str) -> list[list[int]]:
    return [PROMPTS[name] for name in names]


@pytest.fixture(scope="session")
def baseline(vllm_models, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """{arch: {prompt name: {"tokens", "logprobs"}}}: greedy, 8 tokens, vLLM alone (no connector)."""
    return _once("baseline", lambda: _run_baseline(vllm_models, tmp_path_factory))


def _run_baseline(vllm_models, tmp_path_factory) -> dict[str, dict[str, dict]]:
    workdir = tmp_path_factory.mktemp("vllm-baseline")
    processes = VllmProcesses(workdir)
    names = list(PROMPTS)
    try:
        running = {
            arch: processes.start(engine_job(model, prompts(*names)), runner_env(), f"baseline-{arch}")
            for arch, model in vllm_models.items()
        }
        results = {arch: process.message() for arch, process in running.items()}
    finally:
        processes.close()
    return {arch: as_baseline(r, names) for arch, r in results.items()}


def as_baseline(result: dict, names: list[str]) -> dict[str, dict]:
    """{name: {"tokens", "logprobs"}} of a round's requests, named in order (what assert_same_as_baseline takes)."""
    return {
        name: {"tokens": result["outputs"][i], "logprobs": sampled_logprobs(result, i)} for i, name in enumerate(names)
    }


def sampled_logprobs(result: dict, index: int) -> list[float]:
    """The logprob of each generated token of request `index` (jobs ask for logprobs=0: the sampled one only)."""
    return [step[str(token)] for step, token in zip(result["logprobs"][index], result["outputs"][index])]


def assert_same_as_baseline(result: dict, names: list[str], expected: dict[str, dict], *, max_tokens: int = 8):
    """Every request's greedy tokens equal vLLM's alone, and their logprobs agree to fp32 rounding."""
    for i, name in enumerate(names):
        want = expected[name]
        assert result["outputs"][i] == want["tokens"][:max_tokens], (
            f"{name}: {result['outputs'][i]} != baseline {want['tokens'][:max_tokens]} "
            f"(num_cached_tokens {result['num_cached_tokens'][i]})"
        )
        if result.get("logprobs") is not None:
            got = sampled_logprobs(result, i)
            diffs = [abs(a - b) for a, b in zip(got, want["logprobs"][:max_tokens])]
            assert max(diffs) <= LOGPROB_ATOL, f"{name}: logprobs {got} vs baseline {want['logprobs']}"


def connector_stat(result: dict, name: str) -> float:
    """A KCaaSConnector counter summed over the round (its per-step stats payloads as vLLM collected them)."""
    return sum(step.get(name, 0) for step in result.get("connector_stats") or [])


class VllmServer:
    """One OpenAI-compatible vLLM server process group (its log: a file). vllm-cpu 0.32.0's `vllm` CLI (`vllm serve`,
    `python -m vllm.entrypoints.cli.main serve`) cannot start: it asks importlib.metadata for the version of a
    distribution named "vllm", and this one is "vllm-cpu" (PackageNotFoundError). The server module takes the same
    flags with the model as --model: `python -m vllm.entrypoints.openai.api_server --model MODEL ...`."""

    def __init__(
        self,
        model: str,
        transfer: dict | None,
        env: dict[str, str],
        workdir,
        name: str,
        *,
        extra_args: tuple[str, ...] = ("--no-enable-prefix-caching",),
        served_model_name: str | None = None,
    ):
        self.model, self.name = served_model_name or model, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w+")
        command = [
            vllm_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            *(["--kv-transfer-config", json.dumps(transfer)] if transfer else []),
            *(["--served-model-name", served_model_name] if served_model_name else []),
            *extra_args,
        ]
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def healthy(self) -> bool:
        assert self.process.poll() is None, f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def complete(self, prompt: list[int], max_tokens: int = 8, url: str | None = None) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            (url or self.url) + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{self.name}: {exc.code} {exc.read()[:2000]!r}\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=30)
        self._log.close()


# ---- the platform ----------------------------------------------------------------------------------------------------


@pytest.fixture
def vllm_agent_launcher(live_server, control_worker, pki, tmp_path):
    launcher = AgentLauncher(live_server.url, pki, NODE_DEVICE_BYTES, tmp_path)
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture
def vllm_agent(vllm_agent_launcher):
    return vllm_agent_launcher.start()


def engine_spec(model_dir: str, *, block_size: int = 16, **overrides) -> KVCacheSpec:
    """The cache layout the engine's KV needs (fingerprint "<model dir>@main", float32), fields overridable."""
    spec = spec_from_hf_config(model_dir, block_size=block_size, kv_dtype="float32")
    return KVCacheSpec(**{**spec.to_dict(), **overrides})


class Tenant:
    """A fresh tenant (tests.e2e.conftest.tenant_key), its SDK client, and data-plane clients of its caches."""

    def __init__(self, url: str, pki):
        self.url, self.pki = url, pki
        self.key = tenant_key()
        self.client = kcaas.Client(url, self.key)
        self._opened: list = [self.client]

    def attach(self, name: str, spec: KVCacheSpec, device_bytes: int = CACHE_DEVICE_BYTES):
        cache = self.client.attach(name, spec, {"device": device_bytes}, timeout=30)
        assert cache.is_ready, cache
        return cache

    def data_plane(self, cache, access: str = "readwrite") -> DataPlaneClient:
        dp = DataPlaneClient(
            cache.endpoint,
            TokenSource(self.client, cache.id, access),
            cache.id,
            cache.spec,
            ssl_context=client_tls(self.pki),
            timeout=10.0,
        )
        self._opened.append(dp)
        return dp

    def env(self, **extra: str) -> dict[str, str]:
        return runner_env(self.key, **extra)

    def close(self) -> None:
        for thing in reversed(self._opened):
            thing.close()


@pytest.fixture
def tenants(live_server, pki):
    """tenants() -> a new Tenant; all closed at teardown."""
    made: list[Tenant] = []

    def make() -> Tenant:
        tenant = Tenant(live_server.url, pki)
        made.append(tenant)
        return tenant

    try:
        yield make
    finally:
        for tenant in made:
            tenant.close()


def agent_metric(agent, name: str, **labels: str) -> float:
    """A sample of the agent process's Prometheus /metrics (its port: KCAAS_NODE_METRICS_PORT in its environment,
    as tests/e2e/conftest.AgentLauncher set it); 0 when not exported yet."""
    from prometheus_client.parser import text_string_to_metric_families

    environ = Path(f"/proc/{agent.process.pid}/environ").read_bytes().split(b"\0")
    port = next(int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"KCAAS_NODE_METRICS_PORT="))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def wait_cached(dp: DataPlaneClient, expected: dict[str, int], timeout: float = 60.0) -> None:
    """Until the cache holds at least expected[name] tokens of each prompt (an engine's async saves landed)."""

    def landed() -> bool:
        return all(dp.lookup(PROMPTS[name]) >= n for name, n in expected.items())

    assert eventually(landed, timeout=timeout, interval=0.1), {name: dp.lookup(PROMPTS[name]) for name in expected}
