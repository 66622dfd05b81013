"""The network store client's pipelined batches on a real Mooncake Store: a batch over several chunks stores and
reads back every object whole (no buffer is written again while its transfer is in flight), a fill that fails midway
is a fault that leaves the next batch intact, the transfer buffers are registered once, and the network tier's writer
sends a burst of puts through the pipeline bit-exact, zeroing each plaintext once sealed. How many objects a chunk
holds by default follows the machine's cores (object_store.default_chunk_blocks); here it is fixed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_node.engine.block_hash import BlockHash
from gpu_node.engine.checksum import block_checksum
from gpu_node.tiers import object_store
from gpu_node.tiers.guarded_store import GuardedStore
from gpu_node.tiers.network_tier import NetworkTier
from gpu_node.tiers.object_store import MooncakeObjectStore
from tests.waiting import eventually

MIB = 1 << 20
CHUNK = object_store.PIPELINE_CHUNK_BLOCKS  # pipelined whatever this machine's cores (its default may not be)


@pytest.fixture
def client(network_store):
    raw = MooncakeObjectStore(network_store.master, network_store.metadata_url, chunk_blocks=CHUNK)
    guarded = GuardedStore(raw, timeout_s=30.0, min_backoff_s=0.05, max_backoff_s=0.05)
    yield raw, guarded
    guarded.close()


def write_all(store: GuardedStore, names: list[str], values: list[bytes], cleanup=None) -> list[bool]:
    filled: list[int] = []

    def fill(i: int, view: memoryview) -> None:
        filled.append(i)
        view[:] = values[i]

    stored = store.write_many(names, [len(v) for v in values], fill, cleanup)
    assert sorted(filled) == list(range(len(names)))  # each object filled exactly once
    return stored


def read_all(store: GuardedStore, names: list[str], slot_bytes: int) -> list[bytes | None]:
    return store.read_many(names, lambda _name, view: bytes(view), slot_bytes)


def test_a_batch_over_several_chunks_is_stored_and_read_back_whole(client):
    _, store = client
    count = 3 * CHUNK - 1  # chunks of 4, 4 and 3: two buffers, each used again
    names = [f"kc/pipeline/{os.urandom(8).hex()}" for _ in range(count)]
    values = [os.urandom(MIB + 4096 * i) for i in range(count)]  # sizes differ: offsets within a chunk matter
    assert write_all(store, names, values) == [True] * count
    absent = "kc/pipeline/never-written"
    asked = names[:5] + [absent] + names[5:]  # a miss across a chunk border of the read
    got = read_all(store, asked, max(len(v) for v in values))
    assert got == values[:5] + [None] + values[5:]


def test_a_fill_that_fails_midway_is_a_fault_and_the_next_batch_is_intact(client):
    _, store = client
    names = [f"kc/pipeline-fault/{os.urandom(8).hex()}" for _ in range(10)]
    values = [os.urandom(MIB) for _ in names]
    cleanups: list[bool] = []

    def fill(i: int, view: memoryview) -> None:
        if i == CHUNK + 1:  # in the second chunk, while the first is in flight
            raise RuntimeError("sealing failed")
        view[:] = values[i]

    stored = store.write_many(names, [MIB] * len(names), fill, lambda: cleanups.append(True))
    assert stored == [False] * len(names) and store.num_faults == 1 and cleanups == [True]
    assert eventually(lambda: store.healthy, timeout=5)
    again = [f"kc/pipeline-fault/{os.urandom(8).hex()}" for _ in range(9)]
    assert write_all(store, again, values[:9]) == [True] * 9
    assert read_all(store, again, MIB) == values[:9]


@pytest.mark.parametrize("chunk_blocks", [CHUNK, None], ids=["pipelined", "this-machine"])
def test_a_batch_of_another_size_registers_no_new_transfer_buffer(network_store, chunk_blocks):
    raw = MooncakeObjectStore(network_store.master, network_store.metadata_url, chunk_blocks=chunk_blocks)
    store = GuardedStore(raw, timeout_s=30.0)
    record = 2 * MIB + 4096  # a Llama-3-8B-like block's record
    warm = [f"kc/pipeline-buffers/{os.urandom(8).hex()}" for _ in range(8)]  # each buffer used once: registered
    assert write_all(store, warm, [os.urandom(record) for _ in warm]) == [True] * 8
    assert all(read_all(store, warm, record))
    registered = raw.num_buffer_registrations
    for count in (1, 7, 8, 3, 16):  # the writer's batch sizes vary with what was queued
        names = [f"kc/pipeline-buffers/{os.urandom(8).hex()}" for _ in range(count)]
        values = [os.urandom(record) for _ in names]
        assert write_all(store, names, values) == [True] * count
        assert read_all(store, names, record) == values
    assert raw.num_buffer_registrations == registered
    store.close()


def test_the_tier_sends_a_burst_of_puts_through_the_pipeline_bit_exact(client):
    _, store = client
    data_key = os.urandom(32)
    writer, reader = NetworkTier(store, data_key, 1 << 40), NetworkTier(store, data_key, 1 << 40)
    count = 21  # more than a writer batch: several batches, each several chunks
    hashes = [BlockHash(os.urandom(16)) for _ in range(count)]
    payloads = [bytearray(os.urandom(256 * 1024)) for _ in range(count)]
    handed = [bytearray(p) for p in payloads]  # the tier owns what it is given
    lineages = [(BlockHash(os.urandom(16)), np.arange(16 * i, 16 * i + 16, dtype=np.int32)) for i in range(count)]
    for block_hash, payload, lineage in zip(hashes, handed, lineages):
        writer.store(block_hash, payload, block_checksum(payload), lineage)
    assert writer.flush(30)
    assert writer.num_dropped_writes == 0 and all(writer.is_stored(h) for h in hashes)
    assert all(not any(payload) for payload in handed)  # every plaintext zeroed once sealed
    assert reader.probe(hashes) == count
    fetched = reader.fetch_many(hashes)
    assert [f[0] if f else None for f in fetched] == payloads
    assert all(np.array_equal(f[1][1], lineage[1]) for f, lineage in zip(fetched, lineages) if f and f[1])
    assert reader.num_checksum_failures == 0
    writer.check_invariants()
    reader.check_invariants()
    writer.wipe()
    for tier in (writer, reader):
        tier.close()
