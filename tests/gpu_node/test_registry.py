import base64
import threading

import pytest
import torch

from gpu_node.node_tasks import provision
from gpu_node.registry import CacheRegistry, ProvisionError

from .kv_fixtures import prefix_kv, tiny_spec

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
            outcomes.append(refusal.code)

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
    assert reg.resident_snapshot() == [{"cache_id": "c1", "device_bytes": 3 * BLOCK, "dram_bytes": 0, "ssd_bytes": 0,
                                        "hit_tokens": 0, "miss_tokens": 0}]  # fmt: skip


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
    "spec, capacity, key_b64, reason",
    [
        ({**SPEC.to_dict(), "head_dim": 0}, {"device": 4 * BLOCK}, base64.b64encode(KEY).decode(), "invalid_spec"),
        (SPEC.to_dict(), {"device": 4 * BLOCK}, base64.b64encode(b"short").decode(), "invalid_hash_key"),
        (SPEC.to_dict(), {"device": 4 * BLOCK}, "not base64!", "invalid_request"),
        (SPEC.to_dict(), {"device": BLOCK - 1}, base64.b64encode(KEY).decode(), "invalid_capacity"),
        (SPEC.to_dict(), {"device": 40 * BLOCK}, base64.b64encode(KEY).decode(), "insufficient_capacity"),
    ],
)
def test_bad_provisioning_requests_are_answered_with_a_reason_not_an_exception(spec, capacity, key_b64, reason):
    reg = registry()
    assert provision(reg, "c1", spec, capacity, key_b64, 1) == (False, reason)
    assert reg.cache_ids() == []
