"""Routing benchmark: KV-aware routing (kcaas.router, policy kv) against round-robin and least-loaded routing, in
front of the same two real vLLM servers, on a multi-turn trace.

    python -m bench.routing [--quick]

Prints a table, then one JSON object on the last line. The platform is scripts/up.py (`make up`'s embedded
defaults, with its KV-event indexer) in a temporary KCAAS_VAR_DIR; two vLLM OpenAI servers (vLLM's venv,
KCAAS_VLLM_PYTHON) run a random-init Llama (8 layers, hidden 768, 4 KV heads, float32; built once, cached under
$KCAAS_BENCH_CACHE) with prefix caching on, 32-token blocks, room for every conversation's KV (nothing is evicted),
and KV events published over ZMQ; both are registered with the platform. Three routers (`python -m kcaas.router`,
one per policy) stand in front of the same two servers.

Workload (bench/_routing_trace.py): a trace in the Mooncake trace format, generated here: conversations (quick 8,
full 16) over 2 shared system prompts of 512 tokens, 4 turns each, the conversations of a turn in a shuffled order;
each turn's prompt is the conversation so far plus a new turn (100-200 tokens more). Each policy gets its own copy
of the trace (same shapes, other tokens: no policy reuses another's KV). Requests are sent one at a time,
max_tokens 1 (the request's wall time is its TTFT), the policies interleaved request by request in rotating order,
so every policy meets the same machine load.

Figures: per policy, TTFT p50/p90 and the device-memory (HBM) hit rate, the tokens vLLM reports as cached
(usage.prompt_tokens_details.cached_tokens) over prompt tokens; `routed_ttft_speedup_vs_round_robin` and
`routed_ttft_speedup_vs_least_loaded` (their TTFT p50 over KV routing's), `routed_hbm_hit_rate`,
`round_robin_hbm_hit_rate`, `least_loaded_hbm_hit_rate`, and `reachable_hbm_hit_rate`, the upper bound: what any
router could hit, the longest prefix each request shares with an earlier one (whole blocks, never the last token).
Requests one at a time mean the load term of KV routing never engages here: this measures placement by prefix.
The machine is small and shared: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench._routing_trace import BLOCK_TOKENS, make_trace, reusable_tokens, token_ids
from bench._vllm_engines import ModelConfig, engine_env, kill_session, model_dir, probe, vllm_python
from bench._vllm_platform import REPO, Platform, free_port_block

POLICIES = ("kv", "round_robin", "least_loaded")
MODEL = ModelConfig(num_layers=8, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048)
SERVED_NAME = "bench-llama"
QUICK = {"conversations": 8, "turns": 4}
FULL = {"conversations": 16, "turns": 4}
FIGURES = (
    "routed_ttft_speedup_vs_round_robin",
    "routed_ttft_speedup_vs_least_loaded",
    "routed_hbm_hit_rate",
    "round_robin_hbm_hit_rate",
)


def null_result(reason: str, mode: str) -> dict:
    return {"bench": "routing", "mode": mode, "skipped": reason, **dict.fromkeys(FIGURES)}


class Server:
    """One vLLM OpenAI server (its own session), publishing its KV events on `events_port` (+1: replay)."""

    def __init__(self, name: str, python: Path, model: str, cpu: str, workdir: str):
        self.name = name
        base = free_port_block()
        self.port, self.events_port = base, base + 2
        self.url = f"http://127.0.0.1:{self.port}"
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.events_port + 1}",
        }
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
            SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--dtype",
            "float32", "--max-model-len", "4096", "--enforce-eager", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--block-size", str(BLOCK_TOKENS), "--seed", "0",
            "--kv-cache-memory-bytes", str(1 << 30), "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        self.log_path = Path(workdir) / f"{name}.log"
        self._log = open(self.log_path, "w")
        env = engine_env({"VLLM_CPU_OMP_THREADS_BIND": cpu})
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start: {self.log_path.read_text()[-3000:]}")

    def close(self) -> None:
        kill_session(self.proc)
        self._log.close()


class RouterProcess:
    def __init__(self, policy: str, platform: Platform, workdir: str):
        self.policy = policy
        self.port = free_port_block()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(Path(workdir) / f"router-{policy}.log", "w")
        env = {**os.environ, "KCAAS_API_KEY": platform.api_key, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kcaas.router", "--kcaas-url", platform.url, "--model", SERVED_NAME, "--policy",
             policy, "--port", str(self.port)],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, instances: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=2):
                    pass
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.HTTPError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the {self.policy} router did not see {instances} instances")

    def complete(self, prompt: list[int]) -> dict:
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as answer:
            result = json.load(answer)
            instance = answer.headers["x-kcaas-instance"]
        ttft_ms = (time.perf_counter() - started) * 1e3
        cached = (result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"ttft_ms": ttft_ms, "cached_tokens": cached, "prompt_tokens": len(prompt), "instance": instance}

    def close(self) -> None:
        kill_session(self.proc)
        self._log.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(samples: dict[str, list[dict]], reachable: int, prompt_tokens: int) -> dict:
    per_policy = {}
    for policy, runs in samples.items():
        ttft = [r["ttft_ms"] for r in runs]
        per_policy[policy] = {
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": percentile(ttft, 90),
            "hbm_hit_rate": sum(r["cached_tokens"] for r in runs) / sum(r["prompt_tokens"] for r in runs),
            "requests_per_instance": {i: sum(r["instance"] == i for r in runs) for i in ("one", "two")},
        }
    p50 = {policy: s["ttft_p50_ms"] for policy, s in per_policy.items()}
    return {
        "policies": per_policy,
        "routed_ttft_speedup_vs_round_robin": p50["round_robin"] / p50["kv"],
        "routed_ttft_speedup_vs_least_loaded": p50["least_loaded"] / p50["kv"],
        "routed_hbm_hit_rate": per_policy["kv"]["hbm_hit_rate"],
        "round_robin_hbm_hit_rate": per_policy["round_robin"]["hbm_hit_rate"],
        "least_loaded_hbm_hit_rate": per_policy["least_loaded"]["hbm_hit_rate"],
        "reachable_hbm_hit_rate": reachable / prompt_tokens,
    }


def run(mode: str, python: Path, log) -> dict:
    shape = QUICK if mode == "quick" else FULL
    trace = make_trace(system_prompts=2, system_blocks=16, **shape)
    reachable = sum(reusable_tokens(trace))
    directory = model_dir(MODEL, python, log)
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-routing-")
    platform, servers, routers = None, [], []
    try:
        log("starting the platform and two vLLM servers ...")
        platform = Platform(workdir, device_bytes=64 << 20)
        servers = [Server(name, python, directory, cpu, workdir) for name, cpu in (("one", "0"), ("two", "1"))]
        sys.path.insert(0, str(REPO))
        import kcaas

        client = kcaas.Client(platform.url, platform.api_key)
        for server in servers:
            server.wait_healthy()
            client.register_engine(
                server.name,
                model=SERVED_NAME,
                block_size=BLOCK_TOKENS,
                api_base=server.url,
                events_endpoint=f"tcp://127.0.0.1:{server.events_port}",
                replay_endpoint=f"tcp://127.0.0.1:{server.events_port + 1}",
            )
        routers = [RouterProcess(policy, platform, workdir) for policy in POLICIES]
        for router in routers:
            router.wait_ready(len(servers))
        samples: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
        log(f"{len(trace)} requests x {len(POLICIES)} policies, one at a time ...")
        for index, request in enumerate(trace):
            order = routers[index % len(routers) :] + routers[: index % len(routers)]
            for router in order:
                offset = (POLICIES.index(router.policy) + 1) * 1_000_003
                prompt = token_ids(request, offset=offset, vocab=MODEL.vocab_size)
                samples[router.policy].append(router.complete(prompt))
        results = summarize(samples, reachable, sum(r["input_length"] for r in trace))
        results["ttft_ms_samples"] = {p: [round(r["ttft_ms"], 1) for r in s] for p, s in samples.items()}
        results["indexed_instances"] = [
            {"name": e.name, "events_applied": e.events_applied, "gaps": e.gaps, "state": e.state}
            for e in client.engines()
        ]
        return results
    finally:
        for thing in (*routers, *servers):
            thing.close()
        if platform is not None:
            platform.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def table(r: dict) -> str:
    lines = [f"bench.routing ({r['mode']}): {r['requests']} requests per policy, two vLLM servers, {r['model']}"]
    lines.append(f"  {'policy':<14} {'TTFT p50 ms':>11} {'p90 ms':>9} {'HBM hit rate':>13}  requests one/two")
    for policy, s in r["policies"].items():
        split = "/".join(str(n) for n in s["requests_per_instance"].values())
        lines.append(
            f"  {policy:<14} {s['ttft_p50_ms']:>11.1f} {s['ttft_p90_ms']:>9.1f} {s['hbm_hit_rate']:>13.3f}  {split}"
        )
    lines.append(
        f"  KV routing: {r['routed_ttft_speedup_vs_round_robin']:.2f}x vs round-robin, "
        f"{r['routed_ttft_speedup_vs_least_loaded']:.2f}x vs least-loaded (TTFT p50); reachable HBM hit rate "
        f"{r['reachable_hbm_hit_rate']:.3f} (a shared, noisy machine: read the ratios)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 conversations x 4 turns per policy (~5 min)")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    python = vllm_python()
    ok, version = probe(python, "import vllm; print(vllm.__version__)") if python.exists() else (False, "no venv")
    if not ok:
        reason = f"vLLM cannot run from {python}: {version} (make vllm-venv)"
        print(f"bench.routing: {reason}")
        print(json.dumps(null_result(reason, mode)))
        return 0
    started = time.perf_counter()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results = {"bench": "routing", "mode": mode, "vllm_version": version.splitlines()[-1], "model": MODEL.key()}
    shape = QUICK if mode == "quick" else FULL
    results["requests"] = shape["conversations"] * shape["turns"]
    results.update(run(mode, python, log))
    results["bench_seconds"] = time.perf_counter() - started
    print(table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
