"""What a cache hit costs, stage by stage: the vLLM bench's load (the 2,000-token prompt of its 12-layer Llama, 4 KV
heads, head_dim 64, float32; the whole 128-token vLLM blocks, 1,920 tokens = 45 MiB of KV, from a cache of 128-token
blocks: --block-size 16 for the layout the vLLM bench uses now) fetched with
`DataPlaneClient.get(tokens, out=, progress=)` over TLS 1.3 from a node process, as the connector's loader does.

    python -m bench.hit_cost [--quick]

Prints a table, then one JSON object on the last line. The node (a DataPlaneServer hosting the cache on a host pool,
a raw TLS server beside it: bench._dataplane_node) runs in a process of its own. Contenders interleave round by round
(medians after a warm-up round):

- `hit_ms`: the get, un-instrumented;
- `raw_tls_ms`: the bound: the same bytes pulled over a plain TLS 1.3 socket of the same contexts, from the same
  node process, into a reused, touched tensor (recv_into its memory); `hit_vs_raw_tls` = hit_ms / raw_tls_ms
  (1.0: the hit costs what moving its bytes does);
- `memcpy_ms`: one copy of the same bytes into that tensor (what a copy stage would add);
- `hit_busy_ms` / `raw_tls_busy_ms`: both again while another thread of the client process runs Python (an engine's
  scheduler beside its loader): what the GIL adds to each (`gil_cost_ms`).

Then instrumented gets (bench/_hit_cost_probe.py) give `stages_ms`: on the node, check, lookup (hash chain and prefix
walk), block reads, framing, the rest of handling, TLS encrypt + send (wall and CPU), after the send; in the client,
the request, the wait for the answer's first bytes, the head, TLS recv + decrypt into `out` (wall and CPU), parse,
result views and the Python left over. The node's send and the client's receive overlap (the answer streams), so the
node's and the client's stages each add up to the hit, not to each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass

CACHE_ID = "c_hitcost0"
PROMPT_TOKENS = 2000
VLLM_BLOCK = 128  # vLLM's CPU block: the load is its whole blocks of the prompt (as before the finer grain)
CACHE_BLOCK = 128  # the cache's block size by default (the figures in docs/performance.md); --block-size 16 is the
# vLLM bench's layout now (its hits are finer: 2,000 tokens), same load


@dataclass(frozen=True)
class HitConfig:
    rounds: int
    warmup_rounds: int
    gets_per_round: int
    probed_gets: int


QUICK = HitConfig(rounds=3, warmup_rounds=1, gets_per_round=1, probed_gets=4)
FULL = HitConfig(rounds=15, warmup_rounds=2, gets_per_round=5, probed_gets=30)


def hit_fields(block_size: int | None = None) -> dict:
    """The vLLM bench's cache spec fields (bench.vllm_connector's model; CACHE_BLOCK-token blocks unless given)."""
    from bench.vllm_connector import MODEL, spec_dict

    return spec_dict(MODEL, block_size or CACHE_BLOCK)


def load_tokens() -> int:
    """The tokens one load moves: the whole vLLM blocks of the 2,000-token prompt."""
    return PROMPT_TOKENS // VLLM_BLOCK * VLLM_BLOCK


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def spread(samples: list[float]) -> list[float]:
    """[min, max] in ms."""
    return [min(samples) * 1e3, max(samples) * 1e3]


def median_stages(per_get: list[dict[str, float]]) -> dict[str, float]:
    """Stage by stage, the median over the instrumented gets (ms, 3 decimals)."""
    names = per_get[0].keys()
    return {name: round(statistics.median(d.get(name, 0.0) for d in per_get), 3) for name in names}


class BusyThread:
    """A thread of pure-Python work (an engine's scheduler, say) while a contender runs: it holds the GIL except
    when the interpreter makes it give the GIL away."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        total = 0
        while not self._stop.is_set():
            for i in range(1000):
                total += i * i

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _contenders(client, raw, tokens, out, nbytes: int) -> dict:
    """name -> one get of that contender."""
    import torch

    out_bytes = memoryview(out.view(-1).view(torch.uint8).numpy())[:nbytes]
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    layers_seen: list[int] = []
    cond = threading.Condition()

    def progress(layers: int, answered: int) -> None:  # what the connector's loader does with each report
        with cond:
            layers_seen.append(layers)
            cond.notify_all()

    def hit() -> None:
        n, _kv = client.get(tokens, out=out, progress=progress)
        if n != len(tokens):
            raise RuntimeError(f"a hit found {n} of {len(tokens)} tokens")

    def raw_pull() -> None:
        raw.pull(nbytes, out_bytes)

    def memcpy() -> None:
        out.view(-1)[: source.numel()].copy_(source)

    def busy(fn):
        def run() -> None:
            with BusyThread():
                fn()

        return run

    return {"hit": hit, "raw_tls": raw_pull, "memcpy": memcpy, "hit_busy": busy(hit), "raw_tls_busy": busy(raw_pull)}


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of fn()."""
    started, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - started, time.thread_time() - cpu


def _rounds(contenders: dict, cfg: HitConfig, node) -> dict[str, dict[str, list[float]]]:
    """Per contender, its samples: wall and client-thread CPU per get, and the node process's CPU per get (by
    round: /proc's clock ticks)."""
    samples: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": [], "node_cpu": []} for name in contenders}
    for index in range(cfg.warmup_rounds + cfg.rounds):
        for name, fn in contenders.items():
            node_cpu = node.cpu_seconds()
            got = [_timed(fn) for _ in range(cfg.gets_per_round)]
            node_cpu = (node.cpu_seconds() - node_cpu) / cfg.gets_per_round
            if index >= cfg.warmup_rounds:
                samples[name]["wall"] += [wall for wall, _ in got]
                samples[name]["cpu"] += [cpu for _, cpu in got]
                samples[name]["node_cpu"].append(node_cpu)
    return samples


def _probed(client, node, tokens, out, count: int) -> dict:
    """Instrumented gets: the node's and the client's stages (medians), and the instrumented get's own time."""
    from bench._hit_cost_probe import Probe, client_stages, install_client_probes, node_stages, run_probed

    probe = Probe()
    install_client_probes(probe)
    nodes, clients, totals = [], [], []
    try:
        node.stages()
        for _ in range(count):
            started, ended = run_probed(probe, lambda: client.get(tokens, out=out, progress=lambda *_: None))
            calls = probe.take()
            node_calls = node.stages()
            nodes.append(node_stages(node_calls))
            clients.append(client_stages(calls, started, ended))
            totals.append((ended - started) / 1e9)
    finally:
        probe.restore()
    return {"node": median_stages(nodes), "client": median_stages(clients), "instrumented_hit_ms": median_ms(totals)}


def run(cfg: HitConfig, mode: str, block_size: int | None = None) -> dict:
    import multiprocessing as mp
    import os
    import shutil
    import ssl
    import tempfile

    import numpy as np
    import torch

    from bench._dataplane_headline import raw_clients
    from bench._dataplane_node import make_pki, make_signing, make_token, spec_from
    from bench._hit_cost_probe import ProbedNode
    from kcaas.dataplane import DataPlaneClient

    fields = hit_fields(block_size)
    spec = spec_from(fields)
    n = load_tokens()
    nbytes = n * spec.kv_bytes_per_token
    r: dict = {"mode": mode, "cpu_count": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0]}
    r.update(tokens=n, bytes=nbytes, layers=spec.num_layers, block_size=spec.block_size, ssl=ssl.OPENSSL_VERSION)
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-hit-")
    pki = make_pki(workdir)
    private, jwks = make_signing()
    config = {"caches": {CACHE_ID: (fields, 256 << 20)}, "max_frame_bytes": 256 << 20, "raw_bytes": nbytes}
    node = ProbedNode(mp.get_context("spawn"), pki, jwks, workdir, config)
    closers = [node.stop]
    try:
        client_ctx = ssl.create_default_context(cafile=pki["ca"])
        client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        client = DataPlaneClient(
            node.info["endpoint"], make_token(private, jwks, CACHE_ID), CACHE_ID, spec, ssl_context=client_ctx
        )
        closers.append(client.close)
        raw, raw_uds = raw_clients(node.info, client_ctx)
        closers += [raw.close, raw_uds.close]
        prompt = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int32)
        shape = (spec.num_layers, 2, PROMPT_TOKENS, spec.num_kv_heads, spec.head_dim)
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        client.put(prompt, kv)
        tokens = prompt[:n]
        out = torch.zeros((spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim))  # touched: a reused staging
        got, view = client.get(tokens, out=out)
        if got != n or not torch.equal(view, kv[:, :, :n]):
            raise RuntimeError("the hit returned other bytes than were put")
        samples = _rounds(_contenders(client, raw, tokens, out, nbytes), cfg, node)
        stages = _probed(client, node, tokens, out, cfg.probed_gets)
    finally:
        for close in reversed(closers):
            close()
        shutil.rmtree(workdir, ignore_errors=True)
    for name, found in samples.items():
        r[f"{name}_ms"] = round(median_ms(found["wall"]), 2)
        r[f"{name}_ms_range"] = [round(v, 2) for v in spread(found["wall"])]
        r[f"{name}_client_cpu_ms"] = round(median_ms(found["cpu"]), 2)
        r[f"{name}_node_cpu_ms"] = round(median_ms(found["node_cpu"]), 2)
    r["hit_vs_raw_tls"] = round(r["hit_ms"] / r["raw_tls_ms"], 3)
    r["gbps"] = round(nbytes / r["hit_ms"] / 1e6, 3)
    r["raw_tls_gbps"] = round(nbytes / r["raw_tls_ms"] / 1e6, 3)
    r["gil_cost_ms"] = round(r["hit_busy_ms"] - r["hit_ms"], 2)
    r["raw_gil_cost_ms"] = round(r["raw_tls_busy_ms"] - r["raw_tls_ms"], 2)
    r["stages_ms"] = {"node": stages["node"], "client": stages["client"]}
    r["instrumented_hit_ms"] = round(stages["instrumented_hit_ms"], 2)
    r["loadavg_1min_at_end"] = os.getloadavg()[0]
    return r


def _table(r: dict) -> str:
    rows = [f"{r['tokens']} tokens, {r['bytes'] / (1 << 20):.1f} MiB of KV, {r['layers']} layers ({r['mode']})"]
    for name in [key[: -len("_ms_range")] for key in r if key.endswith("_ms_range")]:
        low, high = r[f"{name}_ms_range"]
        cpu = f"CPU: client {r[f'{name}_client_cpu_ms']:.2f}, node {r[f'{name}_node_cpu_ms']:.2f}"
        rows.append(f"  {name:<14} {r[f'{name}_ms']:8.2f} ms  [{low:.2f} .. {high:.2f}]  {cpu}")
    rows.append(f"  hit_vs_raw_tls {r['hit_vs_raw_tls']:.3f}   gbps {r['gbps']:.2f} (raw {r['raw_tls_gbps']:.2f})")
    for side, stages in r["stages_ms"].items():
        rows.append(f"  {side} stages (instrumented hit {r['instrumented_hit_ms']:.2f} ms):")
        rows += [f"    {name:<24} {value:8.3f} ms" for name, value in stages.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    parser.add_argument("--block-size", type=int, help="the cache's block size (default 128; the vLLM bench's is 16)")
    args = parser.parse_args(argv)
    cfg, mode = (QUICK, "quick") if args.quick else (FULL, "full")
    results = run(cfg, mode, args.block_size)
    print(_table(results), file=sys.stderr)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
