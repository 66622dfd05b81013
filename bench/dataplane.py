"""Data-plane benchmark: SDK put/get over TLS 1.3 and over the Unix socket against raw sockets pushing the same
bytes between the same two processes, against Redis SET/GET of the same chunks (pipelined), and lookup latency.

    python -m bench.dataplane [--quick]

Prints a human table, then one JSON object on the last line. The node (a DataPlaneServer with a provisioned cache,
plus raw TLS / UDS sink-and-source servers) runs in a separate process (multiprocessing 'spawn'), so client and server
do not share a GIL; the client runs in this process. Every contender runs once per round, interleaved round by round
(median of the measured rounds, after warm-up rounds), because the machines this runs on are shared and noisy: read
the ratios (put_vs_raw_tls, uds_get_vs_raw, uds_get_vs_redis, ...), not the absolute figures.

Layout: Llama-3-8B-like (32 layers, 8 KV heads, head_dim 128, fp16, 16-token blocks): 128 KiB per token, 2 MiB per
block; one operation moves a batch of 16 blocks (256 tokens, 32 MiB). GB/s = 1e9 bytes/s of KV.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

ISSUER = "kcaas-control-plane"
NODE_ID = "bench-node"
CACHE_ID = "c_benchmrk"
EPOCH = 1
BLOCKS_PER_OP = 16
MIB = 1 << 20
_RAW_HEAD = struct.Struct("!cQ")  # op (b"P" push to server, b"G" pull from server, b"Q" quit), length


@dataclass(frozen=True)
class BenchConfig:
    rounds: int
    warmup_rounds: int
    ops_per_round: int  # 32 MiB operations per contender per round
    lookup_samples: int  # lookups of the 4096-token prompt (after 20 warm-up lookups)
    lookup_tokens: int = 4096


QUICK = BenchConfig(rounds=5, warmup_rounds=1, ops_per_round=3, lookup_samples=300)
FULL = BenchConfig(rounds=11, warmup_rounds=2, ops_per_round=8, lookup_samples=2000)


def llama3_8b_like_spec():
    from kcaas.spec import KVCacheSpec

    return KVCacheSpec(model_fingerprint="llama-3-8b-like", num_layers=32, num_kv_heads=8, head_dim=128,
                       block_size=16, kv_dtype="float16", storage_dtype="float16")  # fmt: skip


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


# ---- PKI and tokens (as tests/dataplane/conftest.py) ---------------------------------------------------------------
def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_pki(directory: str) -> dict[str, str]:
    from gpu_node.dev_pki import write_dev_pki

    return write_dev_pki(directory, server_name=NODE_ID, valid_for=dt.timedelta(hours=2))


def make_signing():
    """(Ed25519 private key, JWKS dict with its public key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    members = {"crv": "Ed25519", "kty": "OKP", "x": _b64url(raw)}
    kid = _b64url(hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest())
    return private, {"keys": [{**members, "kid": kid, "use": "sig", "alg": "EdDSA"}]}


def make_token(private, jwks: dict, ttl: int = 3600) -> str:
    import jwt

    now = int(time.time())
    claims = {"iss": ISSUER, "aud": f"cache:{CACHE_ID}", "sub": "tenant:bench", "iat": now, "nbf": now,
              "exp": now + ttl, "jti": str(uuid.uuid4()), "epoch": EPOCH, "node": NODE_ID, "access": "readwrite",
              "scope": "kv:read kv:write"}  # fmt: skip
    return jwt.encode(claims, private, algorithm="EdDSA", headers={"kid": jwks["keys"][0]["kid"], "typ": "JWT"})


# ---- raw socket servers (in the node process) ---------------------------------------------------------------------
def _recv_exact_into(sock, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _raw_serve(sock, buf: bytearray) -> None:
    """Serve one raw connection: P = receive n bytes (into a reused buffer) then ack 1 byte; G = send n bytes."""
    head = bytearray(_RAW_HEAD.size)
    view = memoryview(buf)
    try:
        while True:
            _recv_exact_into(sock, memoryview(head))
            op, n = _RAW_HEAD.unpack(head)
            if op == b"P":
                _recv_exact_into(sock, view[:n])
                sock.sendall(b"k")
            elif op == b"G":
                sock.sendall(view[:n])
            else:
                return
    except (OSError, ConnectionError):
        pass
    finally:
        try:
            sock.close()
        except OSError:
            pass


def _raw_listener(listener, tls_ctx, buf_bytes: int) -> None:
    import threading

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        if tls_ctx is not None:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = tls_ctx.wrap_socket(conn, server_side=True)
        threading.Thread(target=_raw_serve, args=(conn, bytearray(os.urandom(1024)) * (buf_bytes // 1024)),
                         daemon=True).start()  # fmt: skip


def _node_main(conn, pki: dict, jwks: dict, workdir: str, capacity_bytes: int, op_bytes: int) -> None:
    """The node process: a DataPlaneServer (TLS + UDS) hosting one cache, and raw TLS / UDS servers."""
    import threading

    import torch

    from gpu_node.dataplane import DataPlaneServer, TokenVerifier, server_tls_context
    from gpu_node.registry import CacheRegistry

    torch.set_num_threads(1)
    spec = llama3_8b_like_spec()
    registry = CacheRegistry(device_capacity_bytes=capacity_bytes, device="cpu")
    registry.provision(cache_id=CACHE_ID, spec=spec, capacity={"device": capacity_bytes}, hash_key=os.urandom(32),
                       epoch=EPOCH)  # fmt: skip
    uds_path = os.path.join(workdir, "dp.sock")
    server = DataPlaneServer(registry, NODE_ID, TokenVerifier(jwks, issuer=ISSUER),
                             server_tls_context(pki["cert"], pki["key"]), "127.0.0.1", 0, uds_path=uds_path)
    server.start()
    raw_ctx = server_tls_context(pki["cert"], pki["key"])
    raw_tcp = socket.create_server(("127.0.0.1", 0))
    raw_uds_path = os.path.join(workdir, "raw.sock")
    raw_uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw_uds.bind(raw_uds_path)
    raw_uds.listen(8)
    for listener, ctx in ((raw_tcp, raw_ctx), (raw_uds, None)):
        threading.Thread(target=_raw_listener, args=(listener, ctx, op_bytes), daemon=True).start()
    conn.send({"endpoint": server.endpoint, "uds": uds_path, "raw_tcp": raw_tcp.getsockname()[:2],
               "raw_uds": raw_uds_path, "pid": os.getpid()})  # fmt: skip
    conn.recv()  # block until the bench says stop (or the pipe closes)
    server.stop()


# ---- client side ---------------------------------------------------------------------------------------------------
class RawClient:
    def __init__(self, sock):
        self.sock = sock
        self.ack = bytearray(1)

    def push(self, view: memoryview) -> None:
        self.sock.sendall(_RAW_HEAD.pack(b"P", view.nbytes))
        self.sock.sendall(view)
        _recv_exact_into(self.sock, memoryview(self.ack))

    def pull(self, n: int, out: bytearray | None = None) -> bytearray:
        """n bytes from the node: into a fresh buffer per answer (like the SDK's get), or into `out` (reused)."""
        self.sock.sendall(_RAW_HEAD.pack(b"G", n))
        if out is None:
            out = bytearray(n)
        _recv_exact_into(self.sock, memoryview(out)[:n])
        return out

    def close(self) -> None:
        try:
            self.sock.sendall(_RAW_HEAD.pack(b"Q", 0))
            self.sock.close()
        except OSError:
            pass


def _redis_url() -> str:
    return os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/4"


def _connect_redis():
    try:
        import redis
    except ImportError:
        return None, "redis-py is not installed"
    try:
        r = redis.Redis.from_url(_redis_url(), socket_timeout=30)
        r.ping()
        return r, None
    except Exception as exc:  # noqa: BLE001 - any failure means "no Redis here"
        return None, f"{type(exc).__name__}: {exc}"


def run(cfg: BenchConfig, mode: str) -> dict:
    import numpy as np
    import torch

    from kcaas.dataplane import DataPlaneClient

    spec = llama3_8b_like_spec()
    op_tokens = BLOCKS_PER_OP * spec.block_size
    op_bytes = op_tokens * spec.kv_bytes_per_token
    n_ops = cfg.ops_per_round
    # the lookup prompt + the get set + one round of puts (deleted after each round), with slack
    capacity = (cfg.lookup_tokens * spec.kv_bytes_per_token) + 2 * n_ops * op_bytes + 8 * spec.block_bytes
    results: dict = {"mode": mode, "cpu_count": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0],
                     "torch": torch.__version__, "op_tokens": op_tokens, "op_bytes": op_bytes,
                     "block_bytes": spec.block_bytes, "kv_bytes_per_token": spec.kv_bytes_per_token,
                     "ops_per_round": n_ops, "rounds": cfg.rounds, "warmup_rounds": cfg.warmup_rounds,
                     "ssl": ssl.OPENSSL_VERSION}  # fmt: skip
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-dp-")
    pki = make_pki(workdir)
    private, jwks = make_signing()
    token = make_token(private, jwks)
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    node = ctx.Process(target=_node_main, args=(child_conn, pki, jwks, workdir, capacity, op_bytes), daemon=True)
    node.start()
    clients, raws, redis_client = [], [], None
    try:
        if not parent_conn.poll(120):
            raise SystemExit("bench.dataplane: the node process did not start within 120 s")
        info = parent_conn.recv()
        client_ctx = ssl.create_default_context(cafile=pki["ca"])
        client_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        tls = DataPlaneClient(info["endpoint"], token, CACHE_ID, spec, ssl_context=client_ctx)
        uds = DataPlaneClient(None, token, CACHE_ID, spec, uds_path=info["uds"])
        clients += [tls, uds]
        raw_sock = socket.create_connection(tuple(info["raw_tcp"]))
        raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw_tls = RawClient(client_ctx.wrap_socket(raw_sock, server_hostname="127.0.0.1"))
        uds_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        uds_sock.connect(info["raw_uds"])
        raw_uds = RawClient(uds_sock)
        raws += [raw_tls, raw_uds]
        results["tls_version"] = raw_tls.sock.version()

        gen = torch.Generator().manual_seed(0)
        shape = (spec.num_layers, 2, op_tokens, spec.num_kv_heads, spec.head_dim)
        kvs = [torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.float16) for _ in range(n_ops)]
        kv_views = [memoryview(kv.view(torch.uint8).reshape(-1).numpy()) for kv in kvs]
        chunks = [[bytes(v[b * spec.block_bytes : (b + 1) * spec.block_bytes]) for b in range(BLOCKS_PER_OP)]
                  for v in kv_views]  # fmt: skip  # the same bytes as 2 MiB Redis values

        # fixed sets: a 4096-token prompt for lookups, n_ops sequences for gets (put once, over UDS)
        lookup_ids = np.arange(10, 10 + cfg.lookup_tokens, dtype=np.int32)
        lookup_kv = torch.zeros((spec.num_layers, 2, cfg.lookup_tokens, spec.num_kv_heads, spec.head_dim),
                                dtype=torch.float16)  # fmt: skip
        assert uds.put(lookup_ids, lookup_kv)["num_cached"] == cfg.lookup_tokens
        del lookup_kv
        get_ids = [np.asarray(token_range(i, op_tokens, base=200_000), dtype=np.int32) for i in range(n_ops)]
        for ids, kv in zip(get_ids, kvs):
            assert uds.put(ids, kv)["num_cached"] == op_tokens
        n, got = tls.get(get_ids[0])
        assert n == op_tokens and torch.equal(got, kvs[0]), "get over TLS returned other bytes"
        n, got = uds.get(get_ids[-1])
        assert n == op_tokens and torch.equal(got, kvs[-1]), "get over UDS returned other bytes"
        del got

        put_counter = [0]

        def sdk_put(client):
            def fn():
                first = put_counter[0]
                put_counter[0] += n_ops
                seqs = [np.asarray(token_range(first + i, op_tokens, base=1_000_000), dtype=np.int32)
                        for i in range(n_ops)]  # fmt: skip
                start = time.perf_counter()
                for ids, kv in zip(seqs, kvs):
                    reply = client.put(ids, kv)
                    if reply["num_written"] != op_tokens:
                        raise RuntimeError(f"a put wrote {reply['num_written']} of {op_tokens} tokens: {reply}")
                elapsed = time.perf_counter() - start
                for ids in seqs:  # outside the timing: free the room for the next round
                    client.delete(ids)
                return gbps(n_ops * op_bytes, elapsed)

            return fn

        staging = torch.empty(op_bytes // 2, dtype=torch.float16)
        staging.fill_(0)  # touched once: an engine reuses its staging buffer across gets (get(out=))

        def sdk_get(client):
            def fn():
                start = time.perf_counter()
                for ids in get_ids:
                    n, _kv = client.get(ids, out=staging)
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

        def raw_pull(raw, out=None):
            def fn():
                start = time.perf_counter()
                for _ in range(n_ops):
                    raw.pull(op_bytes, out)
                return gbps(n_ops * op_bytes, time.perf_counter() - start)

            return fn

        contenders = {
            "put_gbps": sdk_put(tls), "raw_tls_gbps": raw_push(raw_tls), "get_gbps": sdk_get(tls),
            "raw_tls_pull_gbps": raw_pull(raw_tls),
            "uds_put_gbps": sdk_put(uds), "raw_uds_gbps": raw_push(raw_uds), "uds_get_gbps": sdk_get(uds),
            "raw_uds_pull_gbps": raw_pull(raw_uds),
            # diagnostics: the same pulls into one reused buffer (no first touch of fresh pages per answer)
            "raw_tls_pull_reused_gbps": raw_pull(raw_tls, reused),
            "raw_uds_pull_reused_gbps": raw_pull(raw_uds, reused),
        }  # fmt: skip
        redis_client, redis_error = _connect_redis()
        results["redis_url"] = _redis_url()
        if redis_client is not None:
            prefix = f"kcaas-bench-dp:{os.getpid()}:"
            keys = [[f"{prefix}{i}:{b}" for b in range(BLOCKS_PER_OP)] for i in range(n_ops)]

            def redis_set():
                start = time.perf_counter()
                for op_keys, op_chunks in zip(keys, chunks):  # one pipeline per 16-block batch, as for the SDK
                    pipe = redis_client.pipeline(transaction=False)
                    for k, c in zip(op_keys, op_chunks):
                        pipe.set(k, c)
                    pipe.execute()
                return gbps(n_ops * op_bytes, time.perf_counter() - start)

            def redis_get():
                start = time.perf_counter()
                for op_keys in keys:
                    pipe = redis_client.pipeline(transaction=False)
                    for k in op_keys:
                        pipe.get(k)
                    values = pipe.execute()
                    if sum(len(v) for v in values) != op_bytes:
                        raise RuntimeError("Redis GET returned other sizes")
                return gbps(n_ops * op_bytes, time.perf_counter() - start)

            redis_set()  # the GETs need the keys before the first round
            contenders["redis_set_gbps"] = redis_set
            contenders["redis_get_gbps"] = redis_get
        else:
            results["redis_error"] = redis_error
            print(f"bench.dataplane: no Redis at {_redis_url()} ({redis_error}); skipping it "
                  "(start one with scripts/services.sh)", file=sys.stderr)  # fmt: skip

        results.update(median_rounds(contenders, cfg.rounds, cfg.warmup_rounds))

        # lookup of a cached 4096-token prompt over TLS: one round trip each
        for _ in range(20):
            assert tls.lookup(lookup_ids) == cfg.lookup_tokens
        samples = []
        for _ in range(cfg.lookup_samples):
            start = time.perf_counter()
            tls.lookup(lookup_ids)
            samples.append((time.perf_counter() - start) * 1e6)
        results["lookup_p50_us"] = percentile(samples, 50)
        results["lookup_p99_us"] = percentile(samples, 99)
        results["lookup_tokens"] = cfg.lookup_tokens
        results["lookup_samples"] = cfg.lookup_samples
        if redis_client is not None:
            redis_client.delete(*[k for op_keys in keys for k in op_keys])
    finally:
        for c in clients:
            c.close()
        for r in raws:
            r.close()
        if redis_client is not None:
            redis_client.close()
        try:
            parent_conn.send("stop")
        except (OSError, BrokenPipeError):
            pass
        node.join(10)
        if node.is_alive():
            node.terminate()
            node.join(5)
        shutil.rmtree(workdir, ignore_errors=True)
    r = results
    r["put_vs_raw_tls"] = ratio(r["put_gbps"], r["raw_tls_gbps"])
    r["get_vs_raw_tls"] = ratio(r["get_gbps"], r["raw_tls_gbps"])
    r["get_vs_raw_tls_pull"] = ratio(r["get_gbps"], r["raw_tls_pull_gbps"])
    r["uds_put_vs_raw"] = ratio(r["uds_put_gbps"], r["raw_uds_gbps"])
    r["uds_get_vs_raw"] = ratio(r["uds_get_gbps"], r["raw_uds_gbps"])
    r["uds_get_vs_raw_pull"] = ratio(r["uds_get_gbps"], r["raw_uds_pull_gbps"])
    if "redis_get_gbps" in r:
        r["uds_get_vs_redis"] = ratio(r["uds_get_gbps"], r["redis_get_gbps"])
        r["uds_put_vs_redis"] = ratio(r["uds_put_gbps"], r["redis_set_gbps"])
    r["bench_seconds"] = time.perf_counter() - started
    r["loadavg_1min_at_end"] = os.getloadavg()[0]
    return r


def _table(r: dict) -> str:
    def g(key):
        return f"{r[key]:.2f} GB/s" if key in r else "n/a"

    def x(key, target=None):
        if key not in r:
            return "n/a"
        return f"{r[key]:.2f} x" + (f" (target >= {target})" if target else "")

    rows = [
        ("SDK put, TLS 1.3", g("put_gbps"), f"{x('put_vs_raw_tls', 0.7)} raw TLS push"),
        ("SDK get, TLS 1.3", g("get_gbps"),
         f"{x('get_vs_raw_tls', 0.7)} raw TLS push; {x('get_vs_raw_tls_pull')} raw TLS pull"),
        ("raw TLS 1.3 push", g("raw_tls_gbps"), "client -> node process, 1-byte ack"),
        ("raw TLS 1.3 pull", g("raw_tls_pull_gbps"), "node process -> client, into a fresh buffer"),
        ("SDK put, UDS", g("uds_put_gbps"), f"{x('uds_put_vs_raw')} raw UDS push"),
        ("SDK get, UDS", g("uds_get_gbps"),
         f"{x('uds_get_vs_raw', 0.7)} raw UDS push; {x('uds_get_vs_raw_pull')} raw UDS pull"),
        ("raw UDS push", g("raw_uds_gbps"), "client -> node process, 1-byte ack"),
        ("raw UDS pull", g("raw_uds_pull_gbps"), "node process -> client, into a fresh buffer"),
        ("raw TLS pull, reused buf", g("raw_tls_pull_reused_gbps"), "diagnostic: no fresh pages per answer"),
        ("raw UDS pull, reused buf", g("raw_uds_pull_reused_gbps"), "diagnostic: no fresh pages per answer"),
        ("Redis SET (pipelined)", g("redis_set_gbps"),
         f"16 x 2 MiB per pipeline; SDK UDS put = {x('uds_put_vs_redis')}"),
        ("Redis GET (pipelined)", g("redis_get_gbps"), f"SDK UDS get = {x('uds_get_vs_redis', 1.5)}"),
        ("lookup p50 (TLS)", f"{r['lookup_p50_us']:.0f} us", f"{r['lookup_tokens']}-token cached prompt"),
        ("lookup p99 (TLS)", f"{r['lookup_p99_us']:.0f} us", f"{r['lookup_samples']} samples"),
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [
        f"bench.dataplane ({r['mode']}): {r['op_bytes'] // MIB} MiB per op ({r['op_tokens']} tokens, "
        f"{BLOCKS_PER_OP} x {r['block_bytes'] // MIB} MiB blocks), {r['ops_per_round']} ops per contender per "
        f"round, median of {r['rounds']} rounds; {r.get('tls_version', '?')}, {r['ssl']}",
    ]
    lines += [f"  {a:<{widths[0]}}  {b:>{widths[1]}}  {c}" for a, b, c in rows]
    if "redis_error" in r:
        lines.append(f"  Redis skipped: {r['redis_error']}")
    lines.append(
        f"  (load average {r['loadavg_1min_at_start']:.1f} -> {r['loadavg_1min_at_end']:.1f} on "
        f"{r['cpu_count']} cores: a shared, noisy machine; read the ratios, measured side by side in this run)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dataplane", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds and ops (under a minute)")
    args = parser.parse_args(argv)
    results = run(QUICK if args.quick else FULL, "quick" if args.quick else "full")
    print(_table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
