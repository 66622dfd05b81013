"""bench.dataplane's headline contenders: 32 MiB puts and gets of the SDK over TLS 1.3 and a Unix socket, raw pushes
and pulls of the same bytes over the same kinds of socket, Redis pipelined SET/GET of the same 2 MiB blocks, and
lookup latency. Every contender runs once per round, interleaved (median after warm-up rounds)."""

from __future__ import annotations

import os
import socket
import time

from bench._dataplane_node import RawClient
from bench._dataplane_sweeps import gbps


def raw_clients(info: dict, client_ctx) -> tuple[RawClient, RawClient]:
    raw_sock = socket.create_connection(tuple(info["raw_tcp"]))
    raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw_tls = RawClient(client_ctx.wrap_socket(raw_sock, server_hostname="127.0.0.1"))
    uds_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds_sock.connect(info["raw_uds"])
    return raw_tls, RawClient(uds_sock)


def contenders(tls, uds, raw_tls, raw_uds, spec, n_ops: int, redis, get_ids: list, kvs: list) -> dict:
    """name -> a function measuring one round (GB/s). `get_ids`/`kvs`: the sequences stored for the gets."""
    import numpy as np
    import torch

    from bench.dataplane import BLOCKS_PER_OP, token_range

    op_tokens = BLOCKS_PER_OP * spec.block_size
    op_bytes = op_tokens * spec.kv_bytes_per_token
    kv_views = [memoryview(kv.view(torch.uint8).reshape(-1).numpy()) for kv in kvs]
    put_counter = [0]

    def sdk_put(client):
        def fn():
            first = put_counter[0]
            put_counter[0] += n_ops
            seqs = [np.asarray(token_range(first + i, op_tokens, base=1_000_000), dtype=np.int32) for i in range(n_ops)]
            start = time.perf_counter()
            for ids, kv in zip(seqs, kvs):
                reply = client.put(ids, kv)
                if reply["num_written"] != op_tokens:
                    raise RuntimeError(f"a put wrote {reply['num_written']} of {op_tokens} tokens: {reply}")
            elapsed = time.perf_counter() - start
            client.delete_batch(seqs)  # outside the timing: free the room for the next round
            return gbps(n_ops * op_bytes, elapsed)

        return fn

    staging = torch.zeros(op_bytes // 2, dtype=torch.float16)  # touched once: an engine reuses its staging buffer

    def sdk_get(client, out):
        def fn():
            start = time.perf_counter()
            for ids in get_ids:
                n, _kv = client.get(ids, out=out)
                if n != op_tokens:
                    raise RuntimeError(f"a get found {n} of {op_tokens} tokens")
            return gbps(n_ops * op_bytes, time.perf_counter() - start)

        return fn

    def raw_push(raw):
        def fn():
            start = time.perf_counter()
            for v in kv_views:
                raw.push(v)
            return gbps(n_ops * op_bytes, time.perf_counter() - start)

        return fn

    reused = bytearray(op_bytes)
    memoryview(reused)[:] = b"\x01" * op_bytes  # touched, as the SDK's staging is

    def raw_pull(raw, out=None):
        def fn():
            start = time.perf_counter()
            for _ in range(n_ops):
                raw.pull(op_bytes, out)
            return gbps(n_ops * op_bytes, time.perf_counter() - start)

        return fn

    found = {
        "put_gbps": sdk_put(tls),
        "raw_tls_gbps": raw_push(raw_tls),
        "get_gbps": sdk_get(tls, staging),
        "raw_tls_pull_gbps": raw_pull(raw_tls),
        "raw_tls_pull_reused_gbps": raw_pull(raw_tls, reused),
        "uds_put_gbps": sdk_put(uds),
        "raw_uds_gbps": raw_push(raw_uds),
        "uds_get_gbps": sdk_get(uds, staging),
        "raw_uds_pull_gbps": raw_pull(raw_uds),
        "raw_uds_pull_reused_gbps": raw_pull(raw_uds, reused),
        "uds_get_fresh_gbps": sdk_get(uds, None),  # a fresh result per get, as Redis's GET returns
    }
    if redis is not None:
        found.update(_redis_contenders(redis, spec, kv_views, n_ops, op_bytes))
    return found


def _redis_contenders(redis, spec, kv_views: list, n_ops: int, op_bytes: int) -> dict:
    """The same bytes as 2 MiB Redis values, one pipeline per 16-block batch, as the SDK moves a batch per op."""
    from bench.dataplane import BLOCKS_PER_OP

    prefix = f"kcaas-bench-dp:{os.getpid()}:"
    keys = [[f"{prefix}{i}:{b}" for b in range(BLOCKS_PER_OP)] for i in range(n_ops)]
    chunks = [
        [bytes(v[b * spec.block_bytes : (b + 1) * spec.block_bytes]) for b in range(BLOCKS_PER_OP)] for v in kv_views
    ]

    def redis_set():
        start = time.perf_counter()
        for op_keys, op_chunks in zip(keys, chunks):
            pipe = redis.pipeline(transaction=False)
            for k, c in zip(op_keys, op_chunks):
                pipe.set(k, c)
            pipe.execute()
        return gbps(n_ops * op_bytes, time.perf_counter() - start)

    def redis_get():
        start = time.perf_counter()
        for op_keys in keys:
            pipe = redis.pipeline(transaction=False)
            for k in op_keys:
                pipe.get(k)
            values = pipe.execute()
            if sum(len(v) for v in values) != op_bytes:
                raise RuntimeError("Redis GET returned other sizes")
        return gbps(n_ops * op_bytes, time.perf_counter() - start)

    redis_set()  # the GETs need the keys before the first round
    return {"redis_set_gbps": redis_set, "redis_get_gbps": redis_get}


def lookup_latency(client, ids, samples: int, percentile) -> dict:
    """Round trips of lookups of a cached prompt (after 20 warm-up lookups): p50/p99 in microseconds."""
    for _ in range(20):
        client.lookup(ids)
    values = []
    for _ in range(samples):
        start = time.perf_counter()
        client.lookup(ids)
        values.append((time.perf_counter() - start) * 1e6)
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def half_hit_ratio(lookup, full_ids, half_ids, rounds: int = 7, per_round: int = 20) -> float:
    """Time of lookup(half-cached prompt) / time of lookup(fully cached prompt of the same length), interleaved."""
    import statistics

    full, half = [], []
    for index in range(rounds + 1):
        t_full = _time(lambda: [lookup(full_ids) for _ in range(per_round)])
        t_half = _time(lambda: [lookup(half_ids) for _ in range(per_round)])
        if index:
            full.append(t_full)
            half.append(t_half)
    return statistics.median(half) / statistics.median(full)


def engine_half_hit_ratio(num_tokens: int) -> float:
    """The same ratio for PagedKVCache.lookup itself, in process (what the node pays for it, without the wire)."""
    import numpy as np
    import torch

    from gpu_node.engine.paged_cache import PagedKVCache
    from kcaas.spec import KVCacheSpec

    spec = KVCacheSpec(
        model_fingerprint="lookup",
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        block_size=16,
        kv_dtype="float16",
        storage_dtype="float16",
    )
    cache = PagedKVCache(spec, hash_key=os.urandom(32), num_blocks=num_tokens // 8, device="cpu")
    rng = np.random.default_rng(7)
    full = rng.integers(0, 128_000, num_tokens).astype(np.int32)
    half = np.concatenate([full[: num_tokens // 2], rng.integers(0, 128_000, num_tokens // 2).astype(np.int32)])
    cache.put(full, torch.zeros((1, 2, num_tokens, 1, 1), dtype=torch.float16))
    assert cache.lookup(full) == num_tokens and cache.lookup(half) < num_tokens // 2 + spec.block_size
    return half_hit_ratio(cache.lookup, full, half, rounds=9, per_round=50)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
