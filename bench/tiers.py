"""Tier benchmark: the SSD store's write/read bandwidth against a plain file of the same bytes, warm-restart rescan
time, and the latency of a get whose block is promoted from DRAM or from SSD.

    python -m bench.tiers [--quick] [--dir PATH]

Prints a human table, then one JSON object on the last line. Layout: Llama-3-8B-like (2 MiB blocks), as
bench/engine.py.

Honesty about "SSD": the files live on whatever disk --dir is on (default var/bench-tiers under the working
directory), and the kernel page cache turns a re-read into a RAM read. Before every cold read the files are dropped
from the page cache with posix_fadvise(DONTNEED) (after fsync, so the pages are clean and the hint is honoured);
`*_pagecache_*` figures are the warm, RAM-served ones. On a virtual disk the "device" may itself be cached by the
host: compare against disk_baseline_* (a plain write+fsync / cold read of the same bytes), measured side by side.
SSD figures include AES-GCM and xxh3 work; the baseline has none.

The network tier (bench/_network_tier.py, whose docstring defines each `network_*`, `raw_store_*` and
`rebuild_after_node_loss_s_per_gib` figure): KCaaS's NetworkTier on a real Mooncake Store whose master and store
server the bench starts (and stops) itself, against the store's own client (its faster of put/put_from and
get/get_into a registered buffer) in interleaved rounds. Without the `mooncake` package those figures are null and
`network_note` says why. Noise: on a small shared machine (2 busy cores, the store's processes among them) absolute
figures move a lot between runs; compare the ratios (`*_vs_*`), measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench._network_tier import FULL, QUICK, measure_network
from gpu_node.engine.checksum import block_checksum
from gpu_node.engine.paged_cache import PagedKVCache
from gpu_node.tiers.lower_tiers import LowerTiers
from gpu_node.tiers.ssd_store import MAX_PENDING_BLOCKS, SsdStore
from kcaas.spec import KVCacheSpec

SPEC = KVCacheSpec(
    model_fingerprint="llama-3-8b-like",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    kv_dtype="float16",
    storage_dtype="float16",
)
GIB = 1 << 30
KEY = os.urandom(32)


def drop_page_cache(directory: str) -> None:
    """posix_fadvise(DONTNEED) every file under `directory` (clean pages only: callers fsync first)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def payloads(num_blocks: int) -> list[tuple[bytes, bytearray]]:
    return [(os.urandom(16), bytearray(os.urandom(SPEC.block_bytes))) for _ in range(num_blocks)]


def measure_disk_baseline(directory: str, blocks) -> dict:
    path = os.path.join(directory, "baseline.bin")
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as file:
        for _, payload in blocks:
            file.write(payload)
        os.fsync(file.fileno())
    write_s = time.perf_counter() - started
    drop_page_cache(directory)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        while file.read(SPEC.block_bytes):
            pass
    read_s = time.perf_counter() - started
    os.unlink(path)
    total = len(blocks) * SPEC.block_bytes
    return {"disk_baseline_write_gbps": total / write_s / 1e9, "disk_baseline_read_gbps": total / read_s / 1e9}


def measure_ssd_store(directory: str, blocks) -> dict:
    store_dir = os.path.join(directory, "store")
    total = len(blocks) * SPEC.block_bytes
    store = SsdStore(store_dir, KEY, 2 * total)
    started = time.perf_counter()
    for i, (block_hash, payload) in enumerate(blocks, 1):
        store.store(block_hash, payload, block_checksum(payload), owned=False)  # compared after
        if i % (MAX_PENDING_BLOCKS // 2) == 0:  # beyond its bound the store drops writes: the full run's 512 blocks
            store.flush()
    store.flush()
    write_s = time.perf_counter() - started
    drop_page_cache(store_dir)
    started = time.perf_counter()
    assert all(store.read(block_hash) == payload for block_hash, payload in blocks)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    for block_hash, _ in blocks:
        store.read(block_hash)
    read_warm_s = time.perf_counter() - started
    store.close()
    drop_page_cache(store_dir)
    started = time.perf_counter()
    reopened = SsdStore(store_dir, KEY, 2 * total)
    rescan_s = time.perf_counter() - started
    assert reopened.num_rescanned_blocks == len(blocks) and reopened.num_checksum_failures == 0
    reopened.wipe()
    return {
        "ssd_write_gbps": total / write_s / 1e9,
        "ssd_read_gbps": total / read_s / 1e9,
        "ssd_read_pagecache_gbps": total / read_warm_s / 1e9,
        "warm_restart_s_per_gib": rescan_s / (total / GIB),
        "ssd_bench_bytes": total,
    }


def measure_hit_latency(directory: str, *, tier: str, rounds: int, device_blocks: int = 4) -> list[float]:
    """Latency (us) of get() on a one-block prefix that lives in `tier` (dram | ssd | ssd_pagecache): the device
    pool holds `device_blocks` blocks and device_blocks + 1 one-block sequences are read round robin, so every get
    promotes its block (and demotes another). Cold SSD reads drop the page cache before each get (untimed)."""
    cache = PagedKVCache(SPEC, hash_key=KEY, num_blocks=device_blocks, device="cpu")
    store = None
    if tier == "dram":
        cache.attach_tiers(LowerTiers(2 * (device_blocks + 1) * SPEC.block_bytes))
    else:
        store = SsdStore(os.path.join(directory, f"hit-{tier}"), KEY, 4 * (device_blocks + 1) * SPEC.block_bytes)
        cache.attach_tiers(LowerTiers(0, store))
    sequences = [list(range(1000 * i, 1000 * i + SPEC.block_size)) for i in range(device_blocks + 1)]
    kv = torch.randn(SPEC.num_layers, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim).to(torch.float16)
    for tokens in sequences:
        cache.put(tokens, kv)
    out = torch.empty(SPEC.num_layers * 2 * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim, dtype=torch.float16)
    samples = []
    for step in range(rounds + len(sequences)):
        tokens = sequences[step % len(sequences)]
        if store is not None:
            store.flush()
            if tier == "ssd":
                drop_page_cache(store.directory)
        started = time.perf_counter()
        n, _ = cache.get(tokens, out=out)
        elapsed = time.perf_counter() - started
        assert n == SPEC.block_size
        if step >= len(sequences):  # the first round trip only fills the lower tier
            samples.append(elapsed * 1e6)
    if store is not None:
        store.wipe()
    return samples


def run(quick: bool, directory: str) -> dict:
    num_blocks, rounds = (32, 30) if quick else (512, 200)
    os.makedirs(directory, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="tiers-", dir=directory)
    try:
        blocks = payloads(num_blocks)
        results = {"mode": "quick" if quick else "full", "block_bytes": SPEC.block_bytes, "dir": workdir}
        results.update(measure_disk_baseline(workdir, blocks))
        results.update(measure_ssd_store(workdir, blocks))
        results["ssd_write_vs_baseline"] = results["ssd_write_gbps"] / results["disk_baseline_write_gbps"]
        results["ssd_read_vs_baseline"] = results["ssd_read_gbps"] / results["disk_baseline_read_gbps"]
        for tier in ("dram", "ssd", "ssd_pagecache"):
            samples = measure_hit_latency(workdir, tier=tier, rounds=rounds)
            results[f"{tier}_hit_p50_us"] = statistics.median(samples)
            results[f"{tier}_hit_p99_us"] = sorted(samples)[int(0.99 * (len(samples) - 1))]
        results["page_cache_note"] = (
            "cold reads drop the page cache with posix_fadvise(DONTNEED) first; *_pagecache_* figures are RAM reads; "
            "a virtual disk may still be cached by its host"
        )
        results.update(measure_network(SPEC, workdir, QUICK if quick else FULL))
        results["loadavg_1min"] = os.getloadavg()[0]
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def network_rows(r: dict) -> list[tuple[str, str, str]]:
    """The human table's network rows ("not measured" when the store is not installed)."""
    if r["network_put_gbps"] is None:
        return [("network tier", "not measured", r["network_note"])]
    return [
        (
            "network tier put",
            f"{r['network_put_gbps']:.2f} GB/s",
            f"raw store {r['raw_store_put_gbps']:.2f} GB/s: x{r['network_put_vs_raw_store']:.2f}",
        ),
        (
            "network tier get (verified)",
            f"{r['network_get_gbps']:.2f} GB/s",
            f"raw store {r['raw_store_get_gbps']:.2f} GB/s: x{r['network_vs_raw_store']:.2f}",
        ),
        (
            "get, block in the network tier",
            f"{r['network_hit_p50_ms']:.1f} ms p50",
            f"p99 {r['network_hit_p99_ms']:.1f} ms",
        ),
        (
            "rebuild after node loss",
            f"{r['rebuild_after_node_loss_s_per_gib']:.2f} s/GiB",
            "fresh node, same keys: lookup + get, bit-exact",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB and 30 gets per tier instead of 1 GiB and 200 (network: smaller)"
    )
    parser.add_argument("--dir", default=os.path.join(os.getcwd(), "var", "bench-tiers"))
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    r = run(args.quick, args.dir)
    rows = [
        (
            "SSD store write",
            f"{r['ssd_write_gbps']:.2f} GB/s",
            f"plain write+fsync {r['disk_baseline_write_gbps']:.2f} GB/s",
        ),
        (
            "SSD store read (cold)",
            f"{r['ssd_read_gbps']:.2f} GB/s",
            f"plain cold read {r['disk_baseline_read_gbps']:.2f} GB/s",
        ),
        ("SSD store read (page cache)", f"{r['ssd_read_pagecache_gbps']:.2f} GB/s", "RAM, not the disk"),
        ("warm restart rescan", f"{r['warm_restart_s_per_gib']:.2f} s/GiB", "every block decrypted and verified"),
        ("get, block in DRAM", f"{r['dram_hit_p50_us']:.0f} us p50", f"p99 {r['dram_hit_p99_us']:.0f} us"),
        ("get, block on SSD (cold)", f"{r['ssd_hit_p50_us']:.0f} us p50", f"p99 {r['ssd_hit_p99_us']:.0f} us"),
        ("get, block on SSD (page cache)", f"{r['ssd_pagecache_hit_p50_us']:.0f} us p50", "RAM-served file read"),
    ]
    for name, value, note in rows + network_rows(r):
        print(f"  {name:32s} {value:>16s}  {note}")
    print(f"  note: {r['page_cache_note']}")
    print(f"  network: {r['network_note']}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
