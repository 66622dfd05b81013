"""Migration throughput against raw TLS over loopback: the same bytes, the same mutual-TLS 1.3 contexts, one run.

    python -m bench.migration [--quick]

migration: a MigrationSender streams every block of a filled cache (checksums, resumable protocol, verification and
insertion on the target) to a MigrationListener; raw_tls: the same block bytes sent with sendall over a TLS socket
of the same contexts and received into one buffer (no checksum, no insertion): the ceiling of the transport.
Rounds alternate the two, after one warm-up round each; the medians are reported. The last line is JSON with
migration_gbps, raw_tls_gbps, migration_vs_raw_tls (target >= 0.7).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from devtools.dev_pki import new_ca, write_node_pki
from gpu_node.agent.registry import CacheRegistry
from gpu_node.migration import block_transfer as bt
from gpu_node.migration.transfer import (
    Incoming,
    MigrationListener,
    MigrationSender,
    mtls_client_context,
    mtls_server_context,
)
from kcaas.spec import KVCacheSpec

QUICK = {"num_blocks": 96, "rounds": 3}
FULL = {"num_blocks": 512, "rounds": 5}
# A Llama-3-8B-like layout: 32 layers x 8 KV heads x 128 dims, fp16, 16 tokens per block = 2 MiB per block.
IDS = {"src": "6e0de000-0000-4000-8000-0000000000c1", "dst": "6e0de000-0000-4000-8000-0000000000c2"}
SPEC = KVCacheSpec(
    model_fingerprint="bench-llama@1",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    kv_dtype="float16",
    storage_dtype="float16",
)


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 bytes per second), as bench/dataplane.py reports."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _files(files: dict) -> dict:
    return {"cert_file": files["cert"], "key_file": files["key"], "ca_file": files["ca"]}


def _filled(num_blocks: int):
    """A source registry holding `num_blocks` full blocks (one sequence), and an empty target at epoch 2."""
    capacity = {"device": (num_blocks + 1) * SPEC.block_bytes}
    source = CacheRegistry(device_capacity_bytes=1 << 40, device="cpu")
    target = CacheRegistry(device_capacity_bytes=1 << 40, device="cpu")
    engine = source.provision(cache_id="c", spec=SPEC, capacity=capacity, hash_key=b"b" * 32, epoch=1).engine
    target.provision(cache_id="c", spec=SPEC, capacity=capacity, hash_key=b"b" * 32, epoch=2)
    tokens = np.arange(num_blocks * SPEC.block_size, dtype=np.int32)
    kv = torch.randn(SPEC.num_layers, 2, len(tokens), SPEC.num_kv_heads, SPEC.head_dim).to(torch.float16)
    assert engine.put(tokens, kv).num_cached_tokens == len(tokens)
    return source, target, engine


def migration_round(engine, target, pki, round_id: int) -> tuple[int, float]:
    """(bytes, seconds) of one full migration into an emptied target."""
    target.get("c").engine.clear()
    listener = MigrationListener(target, mtls_server_context(**_files(pki["dst"]))).start()
    listener.expect(Incoming(f"m{round_id}", "c", IDS["src"], 2))
    try:
        sender = MigrationSender(
            engine,
            migration_id=f"m{round_id}",
            cache_id="c",
            epoch=2,
            target_endpoint=listener.endpoint,
            target_node_id=IDS["dst"],
            tls_context=mtls_client_context(**_files(pki["src"])),
        )
        started = time.perf_counter()
        stats = sender.run()
        elapsed = time.perf_counter() - started
    finally:
        listener.stop()
    assert len(bt.snapshot(target.get("c").engine)) == len(bt.snapshot(engine)), "incomplete copy"
    return stats.bytes_sent, elapsed


def raw_tls_round(engine, pki) -> tuple[int, float]:
    """(bytes, seconds) of sending the same block bytes over a bare mutual-TLS socket."""
    server_ctx = mtls_server_context(**_files(pki["dst"]))
    client_ctx = mtls_client_context(**_files(pki["src"]))
    listener = socket.create_server(("127.0.0.1", 0))
    blocks = [bt.read_block(engine, meta) for meta in bt.snapshot(engine)]
    total = sum(sum(len(p) for p in held.parts) for held in blocks)
    received = []

    def receive():
        raw, _ = listener.accept()
        with server_ctx.wrap_socket(raw, server_side=True) as sock:
            buf, got = memoryview(bytearray(4 << 20)), 0
            while got < total:
                n = sock.recv_into(buf)
                if not n:
                    break
                got += n
            sock.sendall(b"k")
        received.append(got)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        with client_ctx.wrap_socket(socket.create_connection(listener.getsockname())) as sock:
            started = time.perf_counter()
            for held in blocks:
                for part in held.parts:
                    sock.sendall(part)
            sock.recv(1)
            elapsed = time.perf_counter() - started
        thread.join()
    finally:
        listener.close()
        for held in blocks:
            held.release()
    assert received == [total]
    return total, elapsed


def run(config: dict, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        ca_key, ca_cert = new_ca("bench CA", valid_for=dt.timedelta(hours=1))
        pki = {n: write_node_pki(Path(directory), ca_key, ca_cert, IDS[n]) for n in ("src", "dst")}
        _, target, engine = _filled(config["num_blocks"])
        migration_round(engine, target, pki, 0)  # warm-up
        raw_tls_round(engine, pki)
        mig, raw = [], []
        for round_id in range(1, config["rounds"] + 1):
            mig.append(gbps(*migration_round(engine, target, pki, round_id)))
            raw.append(gbps(*raw_tls_round(engine, pki)))
    migration_gbps, raw_tls_gbps = statistics.median(mig), statistics.median(raw)
    return {
        "bench": "migration",
        "mode": mode,
        "num_blocks": config["num_blocks"],
        "block_bytes": SPEC.block_bytes,
        "bytes_per_round": config["num_blocks"] * SPEC.block_bytes,
        "migration_gbps": round(migration_gbps, 3),
        "raw_tls_gbps": round(raw_tls_gbps, 3),
        "migration_vs_raw_tls": round(migration_gbps / raw_tls_gbps, 3),
        "rounds": config["rounds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.migration", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and rounds (well under a minute)")
    args = parser.parse_args()
    print(json.dumps(run(QUICK if args.quick else FULL, "quick" if args.quick else "full")))


if __name__ == "__main__":
    main()
