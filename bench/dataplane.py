"""Data-plane benchmark: the SDK's put/get over TLS 1.3 and a Unix socket against raw sockets moving the same bytes
the same way between the same two processes, against Redis (a private server on a Unix socket, redis-py with
hiredis), by request length, by operation size and by concurrent clients, and lookup latency.

    python -m bench.dataplane [--quick]

Prints tables, then one JSON object on the last line. Nodes (DataPlaneServers with provisioned caches, plus raw TLS /
UDS servers) and clients run in processes of their own (multiprocessing 'spawn'), so nobody shares a GIL. Contenders
are interleaved round by round (medians after a warm-up), because the machines this runs on are shared and noisy:
read the ratios, measured side by side in one run, not the absolute figures.

Like for like (each ratio compares the same direction and the same buffer reuse): a get reads into a reused,
touched buffer (`get(out=)`, as an engine does) and is compared with a raw pull into a reused buffer (get_vs_raw_tls,
get_vs_raw_tls_pull, get_vs_raw_pull, uds_get_vs_raw and uds_get_vs_raw_pull are all that; they compared a pull with
a raw push, or with a pull into fresh memory, before); a put is compared with a raw push into the node's reused
buffer; against Redis, whose GET returns a fresh object, the KCaaS get returns a fresh tensor too (uds_get_vs_redis,
get_vs_redis_by_size; the reused-buffer get is reported beside it).

Layouts: the headline is Llama-3-8B-like (32 layers, 8 KV heads, head_dim 128, fp16, 16-token blocks: 128 KiB per
token, 2 MiB per block), one operation a batch of 16 blocks (256 tokens, 32 MiB). The length sweep (256..131,072
tokens) uses 4 of those layers (16 KiB per token) on a node with 32 MiB frames, which splits a request every 2,047
tokens exactly as 256 MiB frames split the full layout (131,072 full-layout tokens are 16 GiB). The size sweep uses
1 layer (4 KiB per token: 64 KiB is one block). GB/s = 1e9 bytes/s of KV.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field

CACHE_ID = "c_benchmrk"
BLOCKS_PER_OP = 16
MIB = 1 << 20


@dataclass(frozen=True)
class BenchConfig:
    rounds: int
    warmup_rounds: int
    ops_per_round: int  # 32 MiB operations per contender per round
    lookup_samples: int  # lookups of the 4096-token prompt (after 20 warm-up lookups)
    lookup_tokens: int = 4096
    sweep_lengths: tuple = (256, 1024, 2048, 4096, 8192, 32768, 131072)
    sweep_rounds: int = 2
    sizes: tuple = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
    size_rounds: int = 3
    size_budget_s: float = 0.15  # per contender per round, roughly
    client_counts: tuple = (1, 2, 4, 8)
    client_seconds: float = 1.0
    client_rounds: int = 2
    half_hit_tokens: int = 32768
    extra: dict = field(default_factory=dict)


QUICK = BenchConfig(rounds=5, warmup_rounds=1, ops_per_round=3, lookup_samples=300)
FULL = BenchConfig(
    rounds=11,
    warmup_rounds=2,
    ops_per_round=8,
    lookup_samples=2000,
    sweep_rounds=5,
    size_rounds=7,
    size_budget_s=0.4,
    client_seconds=2.0,
    client_rounds=5,
)


def llama3_8b_like_spec(num_layers: int = 32):
    from kcaas.spec import KVCacheSpec

    return KVCacheSpec(
        model_fingerprint="llama-3-8b-like",
        num_layers=num_layers,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        kv_dtype="float16",
        storage_dtype="float16",
    )


# ---- pure helpers (tested in tests/bench/test_dataplane_bench.py) -------------------------------------------------
def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def token_range(index: int, num_tokens: int, base: int = 1000) -> list[int]:
    """Distinct token ids for operation `index` (no two operations share a first block, so every put writes)."""
    start = base + index * num_tokens
    return list(range(start, start + num_tokens))


def median_rounds(contenders: dict, rounds: int, warmup_rounds: int) -> dict[str, float]:
    """Run every contender once per round, interleaved; median of the values it returns over the measured rounds."""
    values: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(warmup_rounds + rounds):
        for name, fn in contenders.items():
            value = fn()
            if index >= warmup_rounds:
                values[name].append(value)
    return {name: statistics.median(v) for name, v in values.items()}


# ---- the run --------------------------------------------------------------------------------------------------------
SWEEP_FRAME_BYTES = 32 * MIB  # with 4 layers: a frame of 2,047 tokens, as 256 MiB frames are for all 32
PAIR_TOKENS = 64  # the two-client comparisons move 8 MiB gets (one frame on either node)


def _node_configs(cfg: BenchConfig) -> tuple[dict, dict]:
    """Node 1 (default frames): the headline cache, the size sweep's, and two small ones; node 2 (32 MiB frames):
    the length sweep's and a third small one."""
    import dataclasses

    full, four, one = (dataclasses.asdict(llama3_8b_like_spec(n)) for n in (32, 4, 1))
    op_bytes = BLOCKS_PER_OP * 16 * (128 << 10)
    headline = cfg.lookup_tokens * (128 << 10) + 2 * cfg.ops_per_round * op_bytes + 8 * (2 << 20)
    size_cache = 6 * max(cfg.sizes) + cfg.half_hit_tokens * (4 << 10) + (64 << 20)
    sweep = (max(cfg.sweep_lengths) + 4096) * (16 << 10)
    pair = 4 * PAIR_TOKENS * (128 << 10)
    one_config = {
        "caches": {
            CACHE_ID: (full, headline),
            "c_size": (one, size_cache),
            "c_pair_a": (full, pair),
            "c_pair_b": (full, pair),
        },
        "max_frame_bytes": 256 * MIB,
        "raw_bytes": op_bytes,
    }
    two_config = {"caches": {"c_sweep": (four, sweep), "c_pair_b2": (full, pair)}, "max_frame_bytes": SWEEP_FRAME_BYTES}
    return one_config, two_config


def run(cfg: BenchConfig, mode: str) -> dict:
    import multiprocessing as mp
    import os
    import shutil
    import ssl
    import tempfile
    import time

    import numpy as np
    import torch

    from bench import _dataplane_headline as headline
    from bench import _dataplane_sweeps as sweeps
    from bench._dataplane_node import NodeProcess, make_pki, make_signing, make_token
    from bench._redis_peer import PrivateRedis
    from kcaas.dataplane import DataPlaneClient

    spec = llama3_8b_like_spec()
    op_tokens = BLOCKS_PER_OP * spec.block_size
    n_ops = cfg.ops_per_round
    r: dict = {
        "mode": mode,
        "cpu_count": os.cpu_count(),
        "loadavg_1min_at_start": os.getloadavg()[0],
        "torch": torch.__version__,
        "op_tokens": op_tokens,
        "op_bytes": op_tokens * spec.kv_bytes_per_token,
        "block_bytes": spec.block_bytes,
        "kv_bytes_per_token": spec.kv_bytes_per_token,
        "ops_per_round": n_ops,
        "rounds": cfg.rounds,
        "warmup_rounds": cfg.warmup_rounds,
        "ssl": ssl.OPENSSL_VERSION,
        "ktls": _ktls_note(),
    }
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-dp-")
    pki = make_pki(workdir)
    private, jwks = make_signing()
    ctx = mp.get_context("spawn")
    one_config, two_config = _node_configs(cfg)
    nodes, closers = [], []
    try:
        nodes += [NodeProcess(ctx, pki, jwks, workdir, one_config), NodeProcess(ctx, pki, jwks, workdir, two_config)]
        one, two = nodes
        client_ctx = ssl.create_default_context(cafile=pki["ca"])
        client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3

        def client(node, cache_id, layers=32, tls=False):
            made = DataPlaneClient(
                node.info["endpoint"] if tls else None,
                make_token(private, jwks, cache_id),
                cache_id,
                llama3_8b_like_spec(layers),
                ssl_context=client_ctx if tls else None,
                uds_path=None if tls else node.info["uds"],
            )
            closers.append(made.close)
            return made

        tls, uds = client(one, CACHE_ID, tls=True), client(one, CACHE_ID)
        raw_tls, raw_uds = headline.raw_clients(one.info, client_ctx)
        closers += [raw_tls.close, raw_uds.close]
        r["tls_version"] = raw_tls.sock.version()
        try:
            redis = PrivateRedis()
            closers.append(redis.close)
            r.update(redis_server=f"private redis-server {redis.version} on a Unix socket", redis_hiredis=redis.hiredis)
        except RuntimeError as exc:
            redis = None
            r["redis_error"] = str(exc)
            print(f"bench.dataplane: no Redis peer ({exc}); its figures are skipped", file=sys.stderr)

        # the fixed sets: a cached prompt for lookups, n_ops sequences for gets (put once, over UDS)
        gen = torch.Generator().manual_seed(0)
        shape = (spec.num_layers, 2, op_tokens, spec.num_kv_heads, spec.head_dim)
        kvs = [torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.float16) for _ in range(n_ops)]
        lookup_ids = np.arange(10, 10 + cfg.lookup_tokens, dtype=np.int32)
        assert (
            uds.put(lookup_ids, torch.zeros((32, 2, cfg.lookup_tokens, 8, 128), dtype=torch.float16))["num_cached"]
            == cfg.lookup_tokens
        )
        get_ids = [np.asarray(token_range(i, op_tokens, base=200_000), dtype=np.int32) for i in range(n_ops)]
        uds.put_batch(list(zip(get_ids, kvs)))
        n, got = tls.get(get_ids[0])
        assert n == op_tokens and torch.equal(got, kvs[0]), "get over TLS returned other bytes"
        del got

        found = headline.contenders(
            tls, uds, raw_tls, raw_uds, spec, n_ops, redis.client if redis else None, get_ids, kvs
        )
        r.update(median_rounds(found, cfg.rounds, cfg.warmup_rounds))
        latency = headline.lookup_latency(tls, lookup_ids, cfg.lookup_samples, percentile)
        r.update(
            lookup_p50_us=latency["p50"],
            lookup_p99_us=latency["p99"],
            lookup_tokens=cfg.lookup_tokens,
            lookup_samples=cfg.lookup_samples,
        )

        print("bench.dataplane: by request length ...", file=sys.stderr)
        r.update(
            sweeps.by_tokens(
                client(two, "c_sweep", layers=4), llama3_8b_like_spec(4), list(cfg.sweep_lengths), cfg.sweep_rounds
            )
        )
        by = r["put_gbps_by_tokens"]
        r["long_put_vs_short_put"] = ratio(by.get("8192", float("nan")), by.get("1024", float("nan")))

        size_client = client(one, "c_size", layers=1)
        if redis is not None:
            print("bench.dataplane: by operation size against Redis ...", file=sys.stderr)
            r.update(
                sweeps.by_size(
                    size_client,
                    redis.client,
                    llama3_8b_like_spec(1),
                    list(cfg.sizes),
                    cfg.size_rounds,
                    cfg.size_budget_s,
                )
            )
            r["small_get_vs_redis"] = r["get_vs_redis_by_size"].get("64KiB")
        full = np.arange(3_000_000, 3_000_000 + cfg.half_hit_tokens, dtype=np.int32)
        half = np.concatenate([full[: cfg.half_hit_tokens // 2], full[cfg.half_hit_tokens // 2 :] + 10_000_000])
        size_client.put(full, torch.zeros((1, 2, cfg.half_hit_tokens, 8, 128), dtype=torch.float16))
        r["wire_lookup_half_hit_vs_full_hit"] = headline.half_hit_ratio(size_client.lookup, full, half)
        r["lookup_half_hit_vs_full_hit"] = headline.engine_half_hit_ratio(cfg.half_hit_tokens)

        print("bench.dataplane: concurrent clients ...", file=sys.stderr)
        r.update(_client_phases(ctx, cfg, one, two, private, jwks, get_ids))
    finally:
        for close in closers:
            close()
        for node in nodes:
            node.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    _ratios(r)
    r["bench_seconds"] = time.perf_counter() - started
    r["loadavg_1min_at_end"] = os.getloadavg()[0]
    return r


def _client_phases(ctx, cfg: BenchConfig, one, two, private, jwks, get_ids: list) -> dict:
    """1..8 client processes on node 1's headline cache; then two clients on two caches, in one node process or two."""
    import dataclasses

    import numpy as np
    import torch

    from bench import _dataplane_sweeps as sweeps
    from bench._dataplane_node import make_token
    from kcaas.dataplane import DataPlaneClient

    full = dataclasses.asdict(llama3_8b_like_spec())
    pair_ids = [list(range(7_000_000 + i * 1000, 7_000_000 + i * 1000 + PAIR_TOKENS)) for i in range(2)]
    for node, cache_id in ((one, "c_pair_a"), (one, "c_pair_b"), (two, "c_pair_b2")):
        with DataPlaneClient(
            None, make_token(private, jwks, cache_id), cache_id, llama3_8b_like_spec(), uds_path=node.info["uds"]
        ) as filler:
            kv = torch.ones((32, 2, PAIR_TOKENS, 8, 128), dtype=torch.float16)
            filler.put_batch([(np.asarray(ids, dtype=np.int32), kv) for ids in pair_ids])
    headline_ids = [ids.tolist() for ids in get_ids]
    specs = [
        (one.info["uds"], make_token(private, jwks, CACHE_ID), CACHE_ID, full, headline_ids, None)
        for _ in range(max(cfg.client_counts))
    ]
    specs += [
        (node.info["uds"], make_token(private, jwks, cache_id), cache_id, full, pair_ids, None)
        for node, cache_id in ((one, "c_pair_a"), (one, "c_pair_b"), (two, "c_pair_b2"))
    ]
    clients = sweeps.Clients(ctx, specs)
    try:
        found = sweeps.by_clients(clients, one, list(cfg.client_counts), cfg.client_seconds, cfg.client_rounds)
        pa = max(cfg.client_counts)
        found.update(
            sweeps.processes_vs_one(
                clients, one, two, [pa, pa + 1], [pa, pa + 2], cfg.client_seconds, cfg.client_rounds
            )
        )
    finally:
        clients.close()
    return found


def _ratios(r: dict) -> None:
    """The ratios, like for like (the module docstring says against what)."""
    r["put_vs_raw_tls"] = ratio(r["put_gbps"], r["raw_tls_gbps"])
    r["uds_put_vs_raw"] = ratio(r["uds_put_gbps"], r["raw_uds_gbps"])
    for name in ("get_vs_raw_tls", "get_vs_raw_tls_pull", "get_vs_raw_pull"):
        r[name] = ratio(r["get_gbps"], r["raw_tls_pull_reused_gbps"])
    for name in ("uds_get_vs_raw", "uds_get_vs_raw_pull"):
        r[name] = ratio(r["uds_get_gbps"], r["raw_uds_pull_reused_gbps"])
    if "redis_get_gbps" in r:
        r["uds_get_vs_redis"] = ratio(r["uds_get_fresh_gbps"], r["redis_get_gbps"])
        r["uds_get_out_vs_redis"] = ratio(r["uds_get_gbps"], r["redis_get_gbps"])
        r["uds_put_vs_redis"] = ratio(r["uds_put_gbps"], r["redis_set_gbps"])
    else:
        r["small_get_vs_redis"] = None


def _ktls_note() -> str:
    """Whether this kernel could take TLS records after the handshake (kTLS): the tls ULP must be available."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_ulp") as ulp:
            available = ulp.read().split()
    except OSError:
        return "unknown (no /proc/sys/net/ipv4/tcp_available_ulp)"
    return (
        "available (tls ULP)" if "tls" in available else f"not on this kernel (ULPs: {' '.join(available) or 'none'})"
    )


def _table(r: dict) -> str:
    from bench._dataplane_report import table

    return table(r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dataplane", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds and ops (a few minutes)")
    args = parser.parse_args(argv)
    results = run(QUICK if args.quick else FULL, "quick" if args.quick else "full")
    print(_table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
