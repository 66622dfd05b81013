"""The network tier's figures for bench/tiers.py: KCaaS's NetworkTier on a real Mooncake Store (a master and a store
server started here by devtools.store_services, stopped at the end, also on error) against the store's own client.

- `network_put_gbps`: payload bytes/s of N blocks stored through KCaaS (the copy LowerTiers.to_network makes, xxh3,
  NetworkTier.store, then flush: the tier's writer sends batches of up to 16, each one store call pipelined in
  chunks of 4, AES-GCM sealing of the next chunk into the client's registered buffer while the last is sent);
- `network_get_gbps`: payload bytes/s of verified reads back on the promotion path (NetworkTier.fetch_many of runs
  of 16 blocks on a fresh tier with the same key after its probe: another node's view; the probe's one batched
  exists() is not timed); `network_get_single_gbps`: one block at a time (NetworkTier.fetch);
- `raw_store_*`: the same number of objects of the same size (the sealed record's length), counted in the same
  payload bytes, through MooncakeDistributedStore itself, set up as KCaaS's client is (no segment of its own, TCP,
  64 MiB local buffer), measured in the same process, interleaved with KCaaS's (the order of the paths alternating;
  the store's segment is touched once before, so no path pays its first page faults). Each raw figure is the
  fastest of the store's paths for the same access, all reported: puts `put`, `put_from` (one registered, reused
  buffer), `batch_put_from` (runs of 16, as KCaaS's writer batches); single gets `get -> bytes`, `get_into` (a
  registered buffer); runs `batch_get_into` (one transfer of the whole run into a registered buffer: KCaaS reads
  the run in pipelined chunks of 4, so the store's one-transfer path is the stricter baseline). The ratios
  divide KCaaS's figure by the best raw one for the same access: `network_vs_raw_store` (runs),
  `network_vs_raw_store_single`, `network_put_vs_raw_store`; `network_note` names the paths;
- KCaaS's client is connected and its transfer buffers used once (`warm_client`) before the clock, as the raw
  client is set up and `warm`ed before it: a running node's client is connected, its buffers faulted in;
- `network_put_stages` / `network_get_stages`: ms per block of each stage KCaaS adds, timed alone (copy, checksum,
  seal, zero; open = decrypt + checksum + the payload's buffer), beside the store's own transfer per block and
  KCaaS's whole path per block from the rounds (`measure_stages`);
- `network_hit_p50_ms` / `_p99_ms`: an engine get() of a one-block (2 MiB) prompt whose block is only in the network
  tier (no DRAM, no SSD): the device pool holds 4 blocks and 5 prompts are read round robin, so every get promotes
  its block from the store (and evicts another, which the store already holds: no write), like the DRAM/SSD hit
  figures of bench/tiers.py. The tier knows the block (no probe RPC in the timed get);
- `rebuild_after_node_loss_s_per_gib`: a first engine writes prompts through to the store and is dropped (the lost
  node); a fresh engine with the same keys and nothing local (its client connected, its CPU pool and the output
  buffers touched before the clock: first-touch page faults are not the store's cost) serves them all back:
  seconds from its first lookup to the last prompt served (each prompt: lookup, which probes the store, then get),
  divided by the GiB served; bit-exactness is checked after the clock stops.

Noise: this runs on whatever cores the machine has (2 busy ones in CI, shared with the store processes and other
work): absolute GB/s move a lot between runs; compare the ratios, measured side by side in one run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from devtools.store_services import MIB, StoreServices, mooncake_importable
from gpu_node.engine.block_hash import BlockHash
from gpu_node.engine.checksum import block_checksum
from gpu_node.engine.paged_cache import PagedKVCache
from gpu_node.engine.zeroing import zero
from gpu_node.tiers import ssd_records
from gpu_node.tiers.guarded_store import GuardedStore
from gpu_node.tiers.host_memory import keep_block_buffers_on_heap
from gpu_node.tiers.lower_tiers import LowerTiers
from gpu_node.tiers.network_tier import NetworkTier
from gpu_node.tiers.object_store import MooncakeObjectStore, default_chunk_blocks
from kcaas.spec import KVCacheSpec

GIB = 1 << 30
TIMEOUT_S = 30.0  # the guard's deadline: a slow, busy machine is not a store fault here
FIGURES = (
    "network_put_gbps",
    "network_get_gbps",
    "network_hit_p50_ms",
    "network_hit_p99_ms",
    "raw_store_put_gbps",
    "raw_store_get_gbps",
    "network_vs_raw_store",
    "network_put_vs_raw_store",
    "network_get_single_gbps",
    "raw_store_get_single_gbps",
    "network_vs_raw_store_single",
    "rebuild_after_node_loss_s_per_gib",
)


@dataclass(frozen=True)
class Size:
    """How much the network part moves: `blocks` per round and `rounds` interleaved rounds (throughput),
    `hit_samples` gets (latency), `prompts` x `prompt_blocks` blocks (rebuild), in a `segment_bytes` store."""

    segment_bytes: int
    blocks: int
    rounds: int
    hit_samples: int
    prompts: int
    prompt_blocks: int


FULL = Size(segment_bytes=1 * GIB, blocks=16, rounds=16, hit_samples=100, prompts=32, prompt_blocks=4)
QUICK = Size(segment_bytes=256 * MIB, blocks=8, rounds=6, hit_samples=20, prompts=8, prompt_blocks=2)
TINY = Size(segment_bytes=64 * MIB, blocks=2, rounds=2, hit_samples=3, prompts=2, prompt_blocks=1)


def measure_network(spec: KVCacheSpec, workdir: str, size: Size) -> dict:
    """Every figure of FIGURES plus `network_note`; the figures are None (and the note says why) when the store is
    not installed. The store's processes are stopped before this returns or raises."""
    if not mooncake_importable():
        return dict.fromkeys(FIGURES) | {
            "network_note": "not measured: the `mooncake` package (pip extra `network`, Linux x86_64) is not importable"
        }
    keep_block_buffers_on_heap()  # the node agent's malloc settings (process-wide: the network figures come last)
    services = StoreServices(os.path.join(workdir, "network-store"), segment_bytes=size.segment_bytes)
    try:
        endpoints = services.start()
        with contextlib.ExitStack() as stack:
            store = GuardedStore(MooncakeObjectStore(endpoints.master, endpoints.metadata_url), timeout_s=TIMEOUT_S)
            stack.callback(store.close)
            warm_client(spec, store)  # connected and its buffers faulted in before the clock, as the raw client's
            raw = RawClient(endpoints.master, endpoints.metadata_url, ssd_records.record_bytes(spec.block_bytes, 16))
            stack.callback(raw.close)
            raw.warm(int(0.85 * size.segment_bytes))
            results = measure_throughput(spec, store, raw, size)
            results |= measure_stages(spec, results)
            samples = measure_hit_latency(spec, store, size.hit_samples)
            results["network_hit_p50_ms"] = statistics.median(samples)
            results["network_hit_p99_ms"] = sorted(samples)[int(0.99 * (len(samples) - 1))]
            results["rebuild_after_node_loss_s_per_gib"] = measure_rebuild(spec, store, endpoints, size)
    finally:
        services.stop()
    chunk_blocks = default_chunk_blocks()
    results["network_note"] = (
        f"Mooncake Store on loopback TCP (1 master, 1 store server, {size.segment_bytes // MIB} MiB segment), "
        f"started by the bench; raw figures: the store's faster path ({results.pop('raw_paths')}); under the node "
        f"agent's malloc settings (gpu_node.tiers.host_memory); KCaaS's transfers carry up to {chunk_blocks} objects "
        "each (object_store.default_chunk_blocks: pipelined chunks of 4 on more than 2 cores)"
    )
    return results


class RawClient:
    """The store's own client, set up as MooncakeObjectStore sets up KCaaS's (no segment, TCP, 64 MiB buffer), with
    one registered buffer of `value_bytes` for put_from / get_into."""

    def __init__(self, master: str, metadata_url: str, value_bytes: int):
        from mooncake.store import MooncakeDistributedStore

        self.client = MooncakeDistributedStore()
        if self.client.setup("127.0.0.1", metadata_url, 0, 64 << 20, "tcp", "", master) != 0:
            raise RuntimeError("the raw Mooncake client's setup failed")
        self.value_bytes = value_bytes
        self.buffer = np.frombuffer(os.urandom(value_bytes), dtype=np.uint8).copy()
        self.pointer = self.buffer.ctypes.data
        self.batch = np.frombuffer(os.urandom(value_bytes * BATCH), dtype=np.uint8).copy()
        self.batch_pointer = self.batch.ctypes.data
        for pointer, nbytes in ((self.pointer, value_bytes), (self.batch_pointer, value_bytes * BATCH)):
            if self.client.register_buffer(pointer, nbytes) != 0:
                raise RuntimeError("register_buffer failed")

    def put_bytes(self, names: list[str], values: list[bytearray]) -> None:
        assert all(self.client.put(name, value) == 0 for name, value in zip(names, values))

    def get_bytes(self, names: list[str]) -> None:
        assert all(len(self.client.get(name)) == self.value_bytes for name in names)

    def put_from(self, names: list[str]) -> None:
        assert all(self.client.put_from(name, self.pointer, self.value_bytes) == 0 for name in names)

    def get_into(self, names: list[str]) -> None:
        assert all(self.client.get_into(name, self.pointer, self.value_bytes) == self.value_bytes for name in names)

    def _slots(self, count: int) -> tuple[list[int], list[int]]:
        return [self.batch_pointer + i * self.value_bytes for i in range(count)], [self.value_bytes] * count

    def batch_put_from(self, names: list[str]) -> None:
        """batch_put_from in runs of BATCH (KCaaS's writer sends its queued puts in batches as large)."""
        for start in range(0, len(names), BATCH):
            run = names[start : start + BATCH]
            assert all(code == 0 for code in self.client.batch_put_from(run, *self._slots(len(run))))

    def batch_get_into(self, names: list[str]) -> None:
        """One batch_get_into of `names` (at most BATCH) into the registered batch buffer."""
        sizes = self.client.batch_get_into(names, *self._slots(len(names)))
        assert all(size == self.value_bytes for size in sizes)

    def warm(self, nbytes: int) -> None:
        """Fill `nbytes` of the store's segment once and empty it: the store server's first touch of its memory
        (page faults) is paid here, not by whichever client happens to be measured first."""
        names = [f"bench/warm/{i}" for i in range(nbytes // self.value_bytes)]
        self.put_from(names)
        self.remove(names)

    def remove(self, names: list[str]) -> None:
        self.client.batch_remove(names, True)

    def close(self) -> None:
        self.client.unregister_buffer(self.pointer)
        self.client.unregister_buffer(self.batch_pointer)
        self.client.close()


def warm_client(spec: KVCacheSpec, store: GuardedStore) -> None:
    """One untimed round trip through KCaaS's client (a tier's batch of puts, then a run of gets): its connection
    and the first touch of its transfer buffers are paid here, as the raw client pays them in its setup and `warm`,
    not by the first measured round. A running node's client is connected and its buffers are in use."""
    tier = NetworkTier(store, os.urandom(32), 1 << 40)
    hashes = [BlockHash(os.urandom(16)) for _ in range(BATCH)]
    for block_hash in hashes:
        payload = bytearray(spec.block_bytes)
        tier.store(block_hash, payload, block_checksum(payload))
    assert tier.flush(TIMEOUT_S) and tier.num_dropped_writes == 0, "the warm-up's puts were not all stored"
    fetched = tier.fetch_many(hashes) + [tier.fetch(hashes[0])]
    assert all(f is not None for f in fetched), f"the warm-up's gets missed {sum(f is None for f in fetched)}"
    tier.wipe()
    tier.close()


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


KINDS = ("kcaas_put", "raw_put", "raw_put_from", "raw_put_batch", "kcaas_get", "raw_get", "raw_get_into")
RUN_KINDS = ("kcaas_get_run", "raw_get_run")
BATCH = 16  # blocks per batched transfer: KCaaS's writer batch (network_tier.WRITE_BATCH_BLOCKS) and a read run


def measure_throughput(spec: KVCacheSpec, store: GuardedStore, raw: RawClient, size: Size) -> dict:
    """Interleaved rounds of `size.blocks` blocks: puts batch by batch (KCaaS's writes are queued, then flushed),
    gets block by block; the order of the paths alternates, so the machine's noise falls on all of them alike."""
    seconds = dict.fromkeys(KINDS + RUN_KINDS, 0.0)
    payloads = [bytearray(os.urandom(spec.block_bytes)) for _ in range(size.blocks)]
    values = [bytearray(os.urandom(raw.value_bytes)) for _ in range(size.blocks)]
    lineages = [(BlockHash(os.urandom(16)), np.arange(i * 16, i * 16 + 16, dtype=np.int32)) for i in range(size.blocks)]
    for round_ in range(size.rounds):
        hashes = [BlockHash(os.urandom(16)) for _ in payloads]
        names = [f"bench/raw/{round_}/{i}" for i in range(size.blocks)]
        names_from = [f"bench/raw-from/{round_}/{i}" for i in range(size.blocks)]
        data_key = os.urandom(32)
        writer, reader = NetworkTier(store, data_key, 1 << 40), NetworkTier(store, data_key, 1 << 40)

        def kcaas_put() -> None:
            for block_hash, payload, lineage in zip(hashes, payloads, lineages):
                copy = bytearray(payload)  # what LowerTiers.to_network hands the tier (which owns and zeroes it)
                writer.store(block_hash, copy, block_checksum(copy), lineage)
            assert writer.flush(TIMEOUT_S)

        names_batch = [f"bench/raw-batch/{round_}/{i}" for i in range(size.blocks)]
        puts = {"kcaas_put": kcaas_put, "raw_put": lambda: raw.put_bytes(names, values)}
        puts["raw_put_from"] = lambda: raw.put_from(names_from)
        puts["raw_put_batch"] = lambda: raw.batch_put_from(names_batch)
        for kind in KINDS[:4] if round_ % 2 == 0 else KINDS[3::-1]:
            seconds[kind] += timed(puts[kind])
        assert writer.num_dropped_writes == 0 and reader.probe(hashes) == size.blocks  # untimed: one exists()
        for i, block_hash in enumerate(hashes):
            gets = {"kcaas_get": lambda: fetched.append(reader.fetch(block_hash))}
            gets |= {"raw_get": lambda: raw.get_bytes(names[i : i + 1])}
            gets["raw_get_into"] = lambda: raw.get_into(names_from[i : i + 1])
            fetched: list = []
            for kind in KINDS[4:] if (round_ + i) % 2 == 0 else KINDS[:3:-1]:
                seconds[kind] += timed(gets[kind])
            assert fetched[0] is not None and fetched[0][0] == payloads[i], "a verified read differs"
        for start in range(0, size.blocks, BATCH):  # a promotion's run: one batched transfer each side
            run = slice(start, start + BATCH)
            runs = {"kcaas_get_run": lambda: fetched.extend(reader.fetch_many(hashes[run]))}
            runs["raw_get_run"] = lambda: raw.batch_get_into(names_batch[run])
            fetched = []
            for kind in RUN_KINDS if (round_ + start) % 2 == 0 else RUN_KINDS[::-1]:
                seconds[kind] += timed(runs[kind])
            assert [f[0] for f in fetched] == payloads[run], "a verified read differs"
        assert reader.num_checksum_failures == 0
        writer.wipe()
        for tier in (reader, writer):
            tier.close()
        raw.remove(names + names_from + names_batch)
    return throughput_figures(size.rounds * size.blocks * spec.block_bytes, seconds)


def throughput_figures(total: int, seconds: dict[str, float]) -> dict:
    """GB/s of each path over `total` payload bytes; each raw figure is the fastest of the store's paths for the
    same access: puts (put, put_from, batch_put_from), single-block gets (get, get_into) and runs (batch_get_into).
    `network_get_gbps` / `network_vs_raw_store` are the promotion path (a run of blocks, batched on both sides);
    the `_single` ones, one block at a time on both sides."""
    gbps = {kind: total / s / 1e9 for kind, s in seconds.items()}
    puts = {"put": gbps["raw_put"], "put_from": gbps["raw_put_from"], "batch_put_from": gbps["raw_put_batch"]}
    put_path = max(puts, key=puts.__getitem__)
    raw_single = max(gbps["raw_get"], gbps["raw_get_into"])
    get_path = "get_into a registered buffer" if gbps["raw_get_into"] > gbps["raw_get"] else "get -> bytes"
    return {
        "network_put_gbps": gbps["kcaas_put"],
        "network_get_gbps": gbps["kcaas_get_run"],
        "network_get_single_gbps": gbps["kcaas_get"],
        "raw_store_put_gbps": puts[put_path],
        "raw_store_get_gbps": gbps["raw_get_run"],
        "raw_store_get_single_gbps": raw_single,
        "raw_store_put_bytes_gbps": gbps["raw_put"],
        "raw_store_put_from_gbps": gbps["raw_put_from"],
        "raw_store_batch_put_from_gbps": gbps["raw_put_batch"],
        "raw_store_get_bytes_gbps": gbps["raw_get"],
        "raw_store_get_into_gbps": gbps["raw_get_into"],
        "raw_store_batch_get_into_gbps": gbps["raw_get_run"],
        "network_vs_raw_store": gbps["kcaas_get_run"] / gbps["raw_get_run"],
        "network_vs_raw_store_single": gbps["kcaas_get"] / raw_single,
        "network_put_vs_raw_store": gbps["kcaas_put"] / puts[put_path],
        "network_bench_bytes": total,
        "raw_paths": f"{put_path}; single gets: {get_path}; runs of {BATCH}: batch_get_into",
    }


STAGE_SAMPLES = 8


def measure_stages(spec: KVCacheSpec, figures: dict) -> dict:
    """Where a block's time goes (`network_put_stages`, `network_get_stages`: ms per block): each stage KCaaS adds,
    timed alone on this thread over the same record layout (the median of STAGE_SAMPLES), beside the store's own
    transfer per block and KCaaS's whole path per block, both from the interleaved rounds. The pipeline overlaps
    sealing with the previous chunk's transfer (puts) and opening with the next chunk's (gets), so the stages may
    sum to more than the whole; on a machine with no idle core they cannot overlap and add up."""
    aead, key_hash = AESGCM(os.urandom(32)), BlockHash(os.urandom(16))
    payload = bytearray(os.urandom(spec.block_bytes))
    lineage = (BlockHash(os.urandom(16)), np.arange(16, dtype=np.int32))
    record = bytearray(ssd_records.record_bytes(spec.block_bytes, 16))
    checksum = block_checksum(payload)
    per_block_ms = {kind: spec.block_bytes / (figures[kind] * 1e9) * 1e3 for kind in FIGURES[:6] if "gbps" in kind}

    def seal() -> None:
        ssd_records.encode_into(memoryview(record), aead, key_hash, payload, checksum, lineage, aad_prefix=b"n")

    def median_ms(work) -> float:
        return statistics.median(timed(work) for _ in range(STAGE_SAMPLES)) * 1e3

    put = {"copy": median_ms(lambda: bytearray(payload)), "checksum": median_ms(lambda: block_checksum(payload))}
    put |= {"seal": median_ms(seal), "zero": median_ms(lambda: zero(bytearray(payload)))}
    put["zero"] -= put["copy"]  # the zeroing of a copy, less the copy
    get = {"open": median_ms(lambda: ssd_records.decode(aead, record, 0, aad_prefix=b"n")), "checksum": put["checksum"]}
    put |= {"store_transfer": per_block_ms["raw_store_put_gbps"], "kcaas_total": per_block_ms["network_put_gbps"]}
    get |= {"store_transfer": per_block_ms["raw_store_get_gbps"], "kcaas_total": per_block_ms["network_get_gbps"]}
    return {"network_put_stages": put, "network_get_stages": get}


def engine(spec: KVCacheSpec, store: GuardedStore, hash_key: bytes, data_key: bytes, blocks: int, **kw):
    cache = PagedKVCache(spec, hash_key=hash_key, num_blocks=blocks, device="cpu")
    cache.attach_tiers(LowerTiers(0, None, NetworkTier(store, data_key, 1 << 40, **kw)))
    return cache


def random_kv(spec: KVCacheSpec, num_tokens: int) -> torch.Tensor:
    shape = (spec.num_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape).to(torch.float16)


def measure_hit_latency(spec: KVCacheSpec, store: GuardedStore, samples: int, device_blocks: int = 4) -> list[float]:
    """Latency (ms) of get() on a one-block prompt that only the network tier holds (see the module docstring)."""
    cache = engine(spec, store, os.urandom(32), os.urandom(32), device_blocks, write_through=True)
    prompts = [list(range(1000 * i, 1000 * i + spec.block_size)) for i in range(device_blocks + 1)]
    for tokens in prompts:
        cache.put(tokens, random_kv(spec, spec.block_size))
    out = torch.empty(spec.num_layers * 2 * spec.block_size * spec.num_kv_heads * spec.head_dim, dtype=torch.float16)
    latencies = []
    try:
        for step in range(samples + len(prompts)):
            before = cache.tiers.moved.get(("get", "network"), 0)
            elapsed = timed(lambda: cache.get(prompts[step % len(prompts)], out=out))
            assert cache.tiers.moved.get(("get", "network"), 0) - before == spec.block_bytes, "not a network hit"
            if step >= len(prompts):  # the first round trip only settles the device pool
                latencies.append(elapsed * 1e3)
    finally:
        cache.tiers.network.wipe()
    return latencies


def measure_rebuild(spec: KVCacheSpec, store: GuardedStore, endpoints, size: Size) -> float:
    """Seconds per GiB for a fresh node to serve back what a lost node wrote through (see the module docstring)."""
    hash_key, data_key = os.urandom(32), os.urandom(32)
    num_blocks = size.prompts * size.prompt_blocks
    num_tokens = size.prompt_blocks * spec.block_size
    prompts = [list(range(100_000 * (i + 1), 100_000 * (i + 1) + num_tokens)) for i in range(size.prompts)]
    expected = [random_kv(spec, num_tokens) for _ in prompts]
    lost = engine(spec, store, hash_key, data_key, num_blocks + 1, write_through=True)
    for tokens, kv in zip(prompts, expected):
        assert lost.put(tokens, kv).num_cached_tokens == num_tokens
    lost.tiers.network.close()  # the node is gone; its objects stay in the store
    del lost
    other = GuardedStore(MooncakeObjectStore(endpoints.master, endpoints.metadata_url), timeout_s=TIMEOUT_S)
    try:
        other.exists(["bench/connect"])  # connected before the clock starts: a running node has its client
        fresh = engine(spec, other, hash_key, data_key, num_blocks + 1)
        fresh.pool.fill_(0)  # first touched before the clock (a GPU pool is device memory, allocated eagerly)
        outs = [torch.zeros_like(kv) for kv in expected]
        served: list[int] = []

        def serve_all() -> None:
            for tokens, out in zip(prompts, outs):
                assert fresh.lookup(tokens) == num_tokens
                served.append(fresh.get(tokens, out=out)[0])

        elapsed = timed(serve_all)
        assert served == [num_tokens] * size.prompts
        assert all(torch.equal(out, kv) for out, kv in zip(outs, expected)), "a rebuilt prompt differs"
        fresh.tiers.network.wipe()
    finally:
        other.close()
    return elapsed / (num_blocks * spec.block_bytes / GIB)
