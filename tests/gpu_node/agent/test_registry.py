import threading

import pytest
import torch

from gpu_node.agent.registry import CacheRegistry, ProvisionError
from gpu_node.agent.tasks import provision
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

SPEC = tiny_spec(block_size=4)
KEY = b"k" * 32
BLOCK = SPEC.block_bytes


def registry(blocks: int = 10) -> CacheRegistry:
    return CacheRegistry(device_capacity_bytes=blocks * BLOCK, device="cpu")


def provision_one(reg, cache_id="c1", *, blocks=4, epoch=1, key=KEY):
    return reg.provision(cache_id=cache_id, spec=SPEC, capacity={"device": blocks * BLOCK}, hash_key=key, epoch=epoch)


def test_provisioning_hosts_a_working_cache_with_the_given_key():
    reg = registry()
    hosted = provision_one(reg)
    assert reg.cache_ids() == ["c1"] and hosted.engine.stats().num_blocks == 4
    tokens = list(range(7))
    hosted.engine.put(tokens, prefix_kv(SPEC, tokens))
    n, kv = hosted.engine.get(tokens)
    assert n == 7 and torch.equal(kv, prefix_kv(SPEC, tokens))


def test_provisioning_is_idempotent_per_epoch_and_a_newer_epoch_replaces():
    reg = registry()
    first = provision_one(reg, epoch=1)
    assert provision_one(reg, epoch=1) is first  # a redelivered message
    assert provision_one(reg, epoch=0) is first  # a stale one
    second = provision_one(reg, epoch=2)
    assert second is not first and reg.get("c1") is second


def test_stale_detach_is_ignored_and_detach_frees_the_budget():
    reg = registry(blocks=4)
    provision_one(reg, epoch=2)
    assert reg.detach(cache_id="c1", epoch=1) is False and reg.cache_ids() == ["c1"]
    assert reg.detach(cache_id="c1", epoch=2) is True and reg.cache_ids() == []
    assert reg.detach(cache_id="c1", epoch=2) is False
    provision_one(reg, "c2", blocks=4)  # the budget came back


def test_the_device_budget_is_never_exceeded_even_by_concurrent_provisionings():
    reg = registry(blocks=10)
    outcomes = []

    def attempt(index):
        try:
            provision_one(reg, f"c{index}", blocks=3)
            outcomes.append("ok")
        except ProvisionError as refusal:
            outcomes.append(refusal.reason)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 3 and outcomes.count("insufficient_capacity") == 5
    assert reg.used_device_bytes() == 9 * BLOCK


def test_resident_snapshot_reports_absolute_bytes_per_cache():
    reg = registry()
    hosted = provision_one(reg)
    tokens = list(range(9))
    hosted.engine.put(tokens, prefix_kv(SPEC, tokens))
    assert reg.resident_snapshot() == [
        {
            "cache_id": "c1",
            "device_bytes": 3 * BLOCK,
            "dram_bytes": 0,
            "ssd_bytes": 0,
            "network_bytes": 0,
            "hit_tokens": 0,
            "miss_tokens": 0,
        }
    ]


def test_resident_snapshot_carries_the_engines_hit_and_miss_token_counters():
    reg = registry()
    hosted = provision_one(reg)
    tokens = list(range(9))
    hosted.engine.put(tokens, prefix_kv(SPEC, tokens))
    hosted.engine.get(tokens + [100, 101])  # 9 tokens cached, 2 not
    [entry] = reg.resident_snapshot()
    stats = hosted.engine.stats()
    assert (entry["hit_tokens"], entry["miss_tokens"]) == (stats.num_hit_tokens, stats.num_miss_tokens)
    assert entry["hit_tokens"] > 0 and entry["miss_tokens"] > 0


@pytest.mark.parametrize(
    "spec, capacity, key, reason",
    [
        ({**SPEC.to_dict(), "head_dim": 0}, {"device": 4 * BLOCK}, KEY, "invalid_spec"),
        (SPEC.to_dict(), {"device": 4 * BLOCK}, b"short", "invalid_hash_key"),
        (SPEC.to_dict(), {"device": 4 * BLOCK}, "a key as text", "invalid_hash_key"),
        (SPEC.to_dict(), {"device": BLOCK - 1}, KEY, "invalid_capacity"),
        (SPEC.to_dict(), {"device": 40 * BLOCK}, KEY, "insufficient_capacity"),
    ],
)
def test_bad_provisioning_requests_are_answered_with_a_reason_not_an_exception(spec, capacity, key, reason):
    reg = registry()
    assert provision(reg, "c1", spec, capacity, key, 1) == (False, reason)
    assert reg.cache_ids() == []


# ---- SSD directories of caches no longer hosted ------------------------------------------------------------------
SSD_KEY = b"s" * 32


def ssd_registry(root) -> CacheRegistry:
    """A registry over one SSD root: a second one over the same root is the agent after a restart."""
    return CacheRegistry(device_capacity_bytes=64 * BLOCK, device="cpu", ssd_dir=str(root))


def provision_on_ssd(reg, cache_id="c1", *, epoch=1):
    return reg.provision(
        cache_id=cache_id,
        spec=SPEC,
        capacity={"device": 4 * BLOCK, "ssd": 64 * BLOCK},
        hash_key=KEY,
        epoch=epoch,
        tenant_id="t1",
        ssd_key=SSD_KEY,
    )


def test_detaching_a_cache_not_hosted_deletes_its_ssd_directory(tmp_path):
    provision_on_ssd(ssd_registry(tmp_path), epoch=3).engine.tiers.close()
    assert (tmp_path / "c1").is_dir()
    restarted = ssd_registry(tmp_path)  # the agent restarted; the cache failed (node lost) meanwhile
    assert restarted.detach(cache_id="c1", epoch=2) is False
    assert (tmp_path / "c1").is_dir()  # a stale detach: epoch 3 wrote the directory
    assert restarted.detach(cache_id="c1", epoch=3) is False  # not hosted, but its blocks are gone from disk
    assert not (tmp_path / "c1").exists() and list(tmp_path.iterdir()) == []
    assert restarted.detach(cache_id="c1", epoch=3) is False  # idempotent


def test_a_registering_node_deletes_only_the_directories_of_caches_it_no_longer_stores(tmp_path):
    first = ssd_registry(tmp_path)
    for cache_id in ("kept", "gone", "hosted"):
        provision_on_ssd(first, cache_id).engine.tiers.close()
    (tmp_path / "not-a-cache").mkdir()  # no owner file: never touched
    restarted = ssd_registry(tmp_path)
    provision_on_ssd(restarted, "hosted")  # hosted again already (not listed: an older answer)
    assert restarted.remove_unplaced_directories(["kept"]) == ["gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosted", "kept", "not-a-cache"]
    warm = provision_on_ssd(restarted, "kept")  # its warm restart reopens the same directory
    assert warm.engine.tiers is not None and (tmp_path / "kept" / "epoch").read_text() == "1"
