"""wipe (erasure's purge) is a fence: holders get an error, never zeros as a hit; bytes in motion are waited for
and a put in flight is discarded; afterwards no byte of the cache's KV remains (real threads)."""

import threading

import pytest
import torch

from gpu_node.engine.cache_state import CachePurged
from gpu_node.tiers.lower_tiers import LowerTiers
from gpu_node.tiers.ssd_store import SsdStore
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache

TOKENS = list(range(100, 116))


def stored_cache(**kwargs):
    cache = tiny_cache(num_blocks=8, **kwargs)
    cache.put(TOKENS, prefix_kv(cache.spec, TOKENS))
    return cache


def test_a_holder_reading_after_the_purge_gets_an_error_not_zeros():
    cache = stored_cache()
    handle = cache.acquire(TOKENS)
    assert handle.num_tokens == 16
    cache.wipe()  # the holder has not started reading: the purge does not wait for it
    with pytest.raises(CachePurged):
        cache.read(handle)
    with pytest.raises(CachePurged):
        cache.kv_views(handle, 0, 16)
    with pytest.raises(CachePurged):
        handle.slot_mapping()
    handle.release()
    assert not cache.pool.any()


def test_every_operation_after_the_purge_is_an_error():
    cache = stored_cache()
    assert cache.wipe() == 4 * cache.spec.block_bytes
    assert cache.wipe() == 0  # idempotent
    for operation in (cache.lookup, cache.get, cache.acquire, cache.delete):
        with pytest.raises(CachePurged):
            operation(TOKENS)
    with pytest.raises(CachePurged):
        cache.put(TOKENS, prefix_kv(cache.spec, TOKENS))
    with pytest.raises(CachePurged):
        cache.clear()


def test_the_purge_waits_for_views_being_sent_then_zeroes_them():
    cache = stored_cache()
    handle = cache.acquire(TOKENS)
    views = cache.kv_views(handle, 0, 16)  # a zero-copy answer is being sent from these
    wiped = threading.Event()
    purger = threading.Thread(target=lambda: (cache.wipe(), wiped.set()))
    purger.start()
    assert not wiped.wait(0.3)  # it waits for the read section
    sent = b"".join(bytes(view) for view in views)
    expected = prefix_kv(cache.spec, TOKENS)
    assert torch.frombuffer(bytearray(sent), dtype=torch.float32).abs().sum() > 0  # real KV, not zeros
    assert torch.frombuffer(bytearray(sent), dtype=torch.float32).sum() == pytest.approx(
        float(expected.sum()), rel=1e-5
    )
    handle.release()
    purger.join(10)
    assert wiped.is_set() and not cache.pool.any()


def test_a_put_whose_bytes_are_moving_is_discarded_and_lands_nowhere():
    cache = tiny_cache(num_blocks=8)
    writing, proceed = threading.Event(), threading.Event()
    real_write = cache._write

    def slow_write(plan, kv, start):
        writing.set()
        assert proceed.wait(10)
        real_write(plan, kv, start)

    cache._write = slow_write
    outcome = {}

    def putter():
        try:
            cache.put(TOKENS, prefix_kv(cache.spec, TOKENS))
        except CachePurged as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=putter)
    thread.start()
    assert writing.wait(10)
    purger = threading.Thread(target=cache.wipe)
    purger.start()
    assert purger.is_alive()
    proceed.set()  # the bytes land in the pool now, before the purge zeroes it
    thread.join(10)
    purger.join(10)
    assert isinstance(outcome.get("error"), CachePurged)  # discarded, never published
    assert not cache.pool.any() and cache.stats().num_cached_blocks == 0
    cache.check_invariants()


def test_the_purge_erases_dram_and_the_ssd_directory(tmp_path):
    cache = tiny_cache(num_blocks=4)
    store = SsdStore(str(tmp_path / "c"), b"D" * 32, 64 * cache.spec.block_bytes)
    cache.attach_tiers(LowerTiers(2 * cache.spec.block_bytes, store))
    for start in (100, 200, 300):
        tokens = list(range(start, start + 16))
        cache.put(tokens, prefix_kv(cache.spec, tokens))
    assert cache.tiers.resident_bytes()["dram"] > 0
    dram_payloads = [entry[0] for entry in cache.tiers.dram._entries.values()]
    cache.wipe()
    assert not (tmp_path / "c").exists()
    assert all(not any(payload) for payload in dram_payloads)  # zeroed, not just forgotten
    assert not cache.pool.any()
