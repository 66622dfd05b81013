"""Tiers as the registry hosts them: per-tier resident bytes, metrics, erasure, detach, and warm restart after a
SIGKILL (two registries over one directory, in separate processes)."""

import json
import multiprocessing
import os
import signal
import time

import torch

from gpu_node.agent.metrics import NodeMetrics
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import provision
from gpu_node.engine.block_hash import tokens_as_int32
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

HASH_KEY, SSD_KEY = b"h" * 32, b"s" * 32
SPEC = tiny_spec()
BLOCK = SPEC.block_bytes
CAPACITY = {"device": 4 * BLOCK, "dram": 2 * BLOCK, "ssd": 4096 * BLOCK}


def seq(start: int) -> list[int]:
    return list(range(start, start + 16))


def hosted_cache(registry, cache_id="c1", tenant="t1", ssd_key=SSD_KEY):
    return registry.provision(
        cache_id=cache_id, spec=SPEC, capacity=CAPACITY, hash_key=HASH_KEY, epoch=1, tenant_id=tenant, ssd_key=ssd_key
    ).engine


def put_seqs(engine, starts):
    for start in starts:
        engine.put(seq(start), prefix_kv(SPEC, seq(start)))


def test_resident_bytes_per_tier_in_snapshots_and_metrics(tmp_path):
    registry = CacheRegistry(device_capacity_bytes=64 * BLOCK, device="cpu", ssd_dir=str(tmp_path))
    engine = hosted_cache(registry)
    put_seqs(engine, [100, 200, 300, 400])
    engine.tiers.ssd.flush()
    [resident] = registry.resident_snapshot()
    assert resident["device_bytes"] == 4 * BLOCK and resident["dram_bytes"] == 2 * BLOCK
    assert resident["ssd_bytes"] == engine.tiers.ssd.bytes_resident >= 6 * BLOCK
    [usage] = registry.usage_snapshot()
    assert (usage["dram_bytes"], usage["ssd_bytes"]) == (resident["dram_bytes"], resident["ssd_bytes"])
    metrics = NodeMetrics(registry).registry
    labels = {"cache": "c1", "tenant": "t1"}
    assert metrics.get_sample_value("kcaas_cache_resident_bytes", {**labels, "tier": "ssd"}) == resident["ssd_bytes"]
    assert metrics.get_sample_value("kcaas_block_checksum_failures_total", {**labels, "where": "ssd"}) == 0
    registry.detach(cache_id="c1", epoch=1)
    assert not (tmp_path / "c1").exists()  # detach deletes the cache's blocks from disk


def test_provision_cache_takes_the_ssd_key_as_a_trailing_optional_argument(tmp_path):
    registry = CacheRegistry(device_capacity_bytes=64 * BLOCK, device="cpu", ssd_dir=str(tmp_path))
    args = ["c1", SPEC.to_dict(), CAPACITY, HASH_KEY, 1, "t1"]
    assert provision(registry, *args) == (True, "")  # an old caller: DRAM only
    assert registry.get("c1").engine.tiers.ssd is None
    assert provision(registry, "c2", *args[1:], b"short") == (False, "invalid_ssd_key")
    assert provision(registry, "c3", *args[1:], SSD_KEY) == (True, "")
    assert registry.get("c3").engine.tiers.ssd is not None and (tmp_path / "c3").is_dir()
    registry.detach(cache_id="c3", epoch=1)


def test_purge_tenant_zeroes_dram_and_deletes_the_tenants_directories_only(tmp_path):
    registry = CacheRegistry(device_capacity_bytes=64 * BLOCK, device="cpu", ssd_dir=str(tmp_path))
    mine, theirs = hosted_cache(registry, "c1", "t1"), hosted_cache(registry, "c2", "t2")
    put_seqs(mine, [100, 200, 300, 400])
    put_seqs(theirs, [100, 200, 300, 400])
    dram_payloads = [p for p, _ in mine.tiers.dram._entries.values()]
    leftover = tmp_path / "old-cache"  # a directory of the tenant from an earlier run, not hosted now
    leftover.mkdir()
    (leftover / "tenant").write_text("t1")
    purged = registry.purge_tenant("t1")
    assert [p["cache_id"] for p in purged] == ["c1"] and purged[0]["freed_bytes"] > 4 * BLOCK
    assert dram_payloads and all(not any(p) for p in dram_payloads)
    assert not (tmp_path / "c1").exists() and not leftover.exists()
    assert (tmp_path / "c2").is_dir() and registry.get("c2") is not None
    registry.detach(cache_id="c2", epoch=1)


# ---- warm restart after SIGKILL -------------------------------------------------------------------------------------
def _writer_process(ssd_dir: str, progress_path: str) -> None:
    """Put sequences forever; after each, publish which ones are wholly durable on SSD (fsync'd, indexed)."""
    torch.set_num_threads(1)
    registry = CacheRegistry(device_capacity_bytes=64 * BLOCK, device="cpu", ssd_dir=ssd_dir)
    engine = hosted_cache(registry)
    store, hasher = engine.tiers.ssd, engine.hasher
    start = 100
    while True:
        put_seqs(engine, [start])
        start += 100
        store.flush()
        indexed = set(store._index)  # fsync'd records only (not the pending ones)
        durable = [
            s for s in range(100, start, 100) if indexed.issuperset(hasher.block_hashes(tokens_as_int32(seq(s))))
        ]
        with open(progress_path + ".tmp", "w") as file:
            json.dump(durable, file)
        os.replace(progress_path + ".tmp", progress_path)


def test_warm_restart_after_sigkill_serves_durable_blocks_bit_exact(tmp_path):
    ssd_dir, progress = str(tmp_path / "ssd"), str(tmp_path / "progress.json")
    child = multiprocessing.get_context("spawn").Process(target=_writer_process, args=(ssd_dir, progress))
    child.start()
    deadline = time.monotonic() + 120
    durable = []
    while len(durable) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
        if os.path.exists(progress):
            with open(progress) as file:
                durable = json.load(file)
    os.kill(child.pid, signal.SIGKILL)  # mid-writes: it never stops putting
    child.join()
    assert len(durable) >= 6
    registry = CacheRegistry(device_capacity_bytes=64 * BLOCK, device="cpu", ssd_dir=ssd_dir)
    engine = hosted_cache(registry)  # same id, epoch and keys: the store rescans the directory
    assert engine.tiers.ssd.num_rescanned_blocks >= 4 * len(durable)
    for start in durable:
        n, kv = engine.get(seq(start))
        assert n == 16 and torch.equal(kv, prefix_kv(SPEC, seq(start)))
    engine.tiers.ssd.check_invariants()
    registry.detach(cache_id="c1", epoch=1)
