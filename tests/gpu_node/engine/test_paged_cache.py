import threading

import numpy as np
import pytest
import torch

from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.spec import IdentityMismatch, KVCacheSpec, SpecError
from tests.gpu_node.kv_fixtures import TEST_KEY, prefix_kv, tiny_cache, tiny_spec


def tokens_of(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def assert_get_exact(cache: PagedKVCache, tokens, expected_n: int) -> None:
    n, kv = cache.get(tokens)
    assert n == expected_n
    assert torch.equal(kv, prefix_kv(cache.spec, tokens[:n]))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("length", [1, 3, 4, 5, 16, 17, 33])
def test_put_then_get_returns_exactly_what_was_put(block_size, length):
    cache = tiny_cache(block_size=block_size, num_blocks=64)
    tokens = tokens_of(length)
    result = cache.put(tokens, prefix_kv(cache.spec, tokens))
    assert (result.num_cached_tokens, result.num_written_tokens, result.out_of_space) == (length, length, False)
    assert result.num_new_blocks == -(-length // block_size)
    assert cache.lookup(tokens) == length
    assert_get_exact(cache, tokens, length)
    cache.check_invariants()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_round_trip_is_bit_exact(dtype):
    cache = tiny_cache(kv_dtype=dtype, storage_dtype=dtype)
    tokens = tokens_of(11)
    cache.put(tokens, prefix_kv(cache.spec, tokens))
    assert_get_exact(cache, tokens, 11)


def test_lookup_is_the_longest_prefix_block_then_token_granular_in_the_tail():
    cache = tiny_cache(block_size=4)
    stored = tokens_of(10)  # blocks [0:4] [4:8] and a partial tail [8:10]
    cache.put(stored, prefix_kv(cache.spec, stored))
    assert cache.lookup(stored[:6] + [7, 7, 7]) == 6  # one full block, then 2 tokens of the second
    assert cache.lookup(stored + [1, 2]) == 10
    assert cache.lookup(stored[:9]) == 9
    assert cache.lookup([5] + stored[1:]) == 0  # a different first token shares nothing
    assert cache.lookup([]) == 0
    assert_get_exact(cache, stored[:6] + [7, 7], 6)


def test_second_put_of_the_same_tokens_deduplicates():
    cache = tiny_cache()
    tokens = tokens_of(10)
    cache.put(tokens, prefix_kv(cache.spec, tokens))
    used = cache.stats().num_used_blocks
    again = cache.put(tokens, prefix_kv(cache.spec, tokens))
    assert (again.num_written_tokens, again.num_new_blocks, again.num_cached_tokens) == (0, 0, 10)
    longer = tokens + tokens_of(8, start=900)
    more = cache.put(longer, prefix_kv(cache.spec, longer))
    assert more.num_written_tokens == 8  # only the new tokens are written (the partial tail grows in place)
    assert cache.stats().num_used_blocks == used + 2
    assert_get_exact(cache, longer, 18)
    assert_get_exact(cache, tokens, 10)


def test_extending_a_partial_block_with_free_slots_writes_in_place():
    cache = tiny_cache(block_size=4)
    short = tokens_of(6)
    cache.put(short, prefix_kv(cache.spec, short))
    longer = short + [555]
    result = cache.put(longer, prefix_kv(cache.spec, longer))
    assert (result.num_new_blocks, result.num_cow_copies, result.num_written_tokens) == (0, 0, 1)
    assert_get_exact(cache, short, 6)
    assert_get_exact(cache, longer, 7)
    cache.check_invariants()


def test_two_sequences_sharing_a_partial_block_then_diverging_copy_on_write():
    cache = tiny_cache(block_size=4)
    shared = tokens_of(6)  # block 0 full; block 1 holds 2 shared tokens
    first = shared + [7001]
    second = shared + [7002, 7003]
    cache.put(first, prefix_kv(cache.spec, first))
    handle_first = cache.acquire(first)
    result = cache.put(second, prefix_kv(cache.spec, second))
    assert result.num_cow_copies == 1 and result.num_new_blocks == 1
    assert result.num_written_tokens == 2  # the 2 shared tail tokens came with the copy
    handle_second = cache.acquire(second)
    assert handle_first.block_ids[0] == handle_second.block_ids[0]  # the full block is shared
    assert handle_first.block_ids[1] != handle_second.block_ids[1]  # the diverged tails are not
    handle_first.release()
    handle_second.release()
    assert_get_exact(cache, first, 7)
    assert_get_exact(cache, second, 8)
    assert_get_exact(cache, shared, 6)
    assert cache.stats().num_cow_copies == 1
    cache.check_invariants()


def test_unreferenced_blocks_are_evicted_lru_only_under_pressure():
    cache = tiny_cache(block_size=4, num_blocks=6)
    a, b, c = tokens_of(8, 100), tokens_of(8, 200), tokens_of(8, 300)
    for seq in (a, b):
        cache.put(seq, prefix_kv(cache.spec, seq))
    assert cache.stats().num_evictions == 0 and cache.lookup(a) == 8
    cache.get(a)  # a is now more recent than b
    cache.put(c, prefix_kv(cache.spec, c))  # needs 2 blocks: 2 free, nothing evicted yet
    assert cache.stats().num_evictions == 0
    d = tokens_of(4, 400)
    cache.put(d, prefix_kv(cache.spec, d))  # pressure: evicts b's tail (the LRU chain, tail first)
    assert cache.stats().num_evictions == 1
    assert (cache.lookup(a), cache.lookup(b), cache.lookup(c)) == (8, 4, 8)
    assert_get_exact(cache, b, 4)
    cache.check_invariants()


def test_when_everything_is_held_put_says_so_and_stores_what_fits():
    cache = tiny_cache(block_size=4, num_blocks=3)
    a = tokens_of(8)
    cache.put(a, prefix_kv(cache.spec, a))
    with cache.acquire(a):
        b = tokens_of(12, 500)
        result = cache.put(b, prefix_kv(cache.spec, b))
        assert result.out_of_space and result.num_cached_tokens == 4  # one free block: a prefix is stored
        c = tokens_of(4, 900)
        with cache.acquire(b):  # now every block is held
            blocked = cache.put(c, prefix_kv(cache.spec, c))
        assert blocked.out_of_space and blocked.num_cached_tokens == 0 and blocked.num_new_blocks == 0
        assert_get_exact(cache, a, 8)
        cache.check_invariants()
    assert_get_exact(cache, b, 4)
    ok = cache.put(c, prefix_kv(cache.spec, c))
    assert not ok.out_of_space and ok.num_cached_tokens == 4


def test_delete_forgets_the_prefix_and_what_hangs_off_it_while_a_reader_keeps_its_bytes():
    cache = tiny_cache(block_size=4, num_blocks=8)
    a = tokens_of(10)
    b = a[:8] + [1, 2, 3]
    for seq in (a, b):
        cache.put(seq, prefix_kv(cache.spec, seq))
    handle = cache.acquire(a)
    assert cache.delete(a[:4]) == 4  # block 0, block 1 and both tails
    assert cache.lookup(a) == 0 and cache.lookup(b) == 0
    kv = cache.get  # a new reader sees nothing
    assert kv(a)[0] == 0
    slots = handle.slot_mapping()
    from kcaas_kernels import read_kv

    held = read_kv(cache.pool, cache.scales, slots, out_dtype=torch.float32)
    assert torch.equal(held, prefix_kv(cache.spec, a))  # the held reader's bytes are intact
    assert cache.stats().num_used_blocks == 3
    handle.release()
    assert cache.stats().num_used_blocks == 0
    cache.check_invariants()


def test_clear_drops_everything():
    cache = tiny_cache()
    for start in (0, 1000):
        seq = tokens_of(9, start)
        cache.put(seq, prefix_kv(cache.spec, seq))
    assert cache.clear() == 6
    stats = cache.stats()
    assert (stats.num_cached_blocks, stats.num_used_blocks, stats.bytes_resident) == (0, 0, 0)


def test_counters_track_hits_misses_and_resident_bytes():
    cache = tiny_cache(block_size=4)
    seq = tokens_of(6)
    cache.put(seq, prefix_kv(cache.spec, seq))
    cache.get(seq + [9, 9])
    cache.get([1, 2, 3])
    stats = cache.stats()
    assert (stats.num_hit_tokens, stats.num_miss_tokens) == (6, 5)
    assert stats.block_bytes == 4 * cache.spec.storage_bytes_per_token == 4 * 2 * 2 * 2 * 4 * 4
    assert stats.bytes_resident == 2 * stats.block_bytes
    assert stats.num_stored_tokens == 6 and stats.num_used_blocks == 2 and stats.num_free_blocks == 62


def test_another_identity_is_refused_naming_the_field():
    cache = tiny_cache()
    other = tiny_spec(num_kv_heads=4)
    with pytest.raises(IdentityMismatch) as err:
        cache.lookup([1, 2], identity=other)
    assert err.value.fields == {"num_kv_heads": (2, 4)}
    assert "num_kv_heads" in str(err.value)
    with pytest.raises(IdentityMismatch):
        cache.put([1], prefix_kv(cache.spec, [1]), identity=tiny_spec(model_fingerprint="other@rev"))
    assert cache.stats().num_used_blocks == 0


def test_kv_of_the_wrong_layout_is_refused_and_stores_nothing():
    cache = tiny_cache()
    seq = tokens_of(5)
    good = prefix_kv(cache.spec, seq)
    for bad in (good[:, :, :4], good.transpose(2, 3).contiguous(), good.to(torch.float16), good[0]):
        with pytest.raises(ValueError):
            cache.put(seq, bad)
    assert cache.stats().num_used_blocks == 0 and cache.lookup(seq) == 0


def test_invalid_specs_are_refused():
    with pytest.raises(SpecError):
        tiny_spec(head_dim=0)
    with pytest.raises(SpecError):
        tiny_spec(storage_dtype="int4")
    with pytest.raises(SpecError):
        KVCacheSpec.from_dict({**tiny_spec().to_dict(), "extra": 1})


def test_two_caches_with_different_keys_never_share_a_hash():
    spec = tiny_spec()
    first = PagedKVCache(spec, hash_key=b"a" * 32, num_blocks=8, device="cpu")
    second = PagedKVCache(spec, hash_key=b"b" * 32, num_blocks=8, device="cpu")
    seq = tokens_of(8)
    for cache in (first, second):
        cache.put(seq, prefix_kv(spec, seq))
    first_keys = {meta.key for meta in first.exchange.list_blocks()}
    assert not first_keys & {meta.key for meta in second.exchange.list_blocks()}


def test_capacity_bytes_sizes_the_pool():
    spec = tiny_spec()
    cache = PagedKVCache(spec, hash_key=TEST_KEY, capacity_bytes=spec.block_bytes * 5 + 1, device="cpu")
    assert cache.stats().num_blocks == 5
    with pytest.raises(ValueError):
        PagedKVCache(spec, hash_key=TEST_KEY, capacity_bytes=spec.block_bytes - 1, device="cpu")


def test_concurrent_puts_and_gets_only_ever_return_exact_kv():
    cache = tiny_cache(block_size=4, num_blocks=40)
    rng = np.random.default_rng(0)
    prefixes = [tokens_of(int(n), 100 * i) for i, n in enumerate(rng.integers(1, 12, size=6))]
    failures: list[str] = []

    def worker(seed: int) -> None:
        local = np.random.default_rng(seed)
        for _ in range(60):
            seq = prefixes[local.integers(len(prefixes))] + local.integers(0, 5, size=local.integers(0, 9)).tolist()
            if local.random() < 0.5:
                cache.put(seq, prefix_kv(cache.spec, seq))
            else:
                n, kv = cache.get(seq)
                if not torch.equal(kv, prefix_kv(cache.spec, seq[:n])):
                    failures.append(f"wrong KV for {seq[:n]}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    cache.check_invariants()
    assert cache.stats().num_used_blocks == cache.stats().num_cached_blocks  # nothing held or leaked


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3"])
def test_quantized_storage_serves_kv_within_the_documented_bound(storage):
    from kcaas_kernels.quant import error_bound

    cache = tiny_cache(block_size=4, storage_dtype=storage, head_dim=8)
    shared = tokens_of(6)
    first, second = shared + [1, 2, 3], shared + [4]  # the second copies the first's partial block on write
    for seq in (first, second):
        cache.put(seq, prefix_kv(cache.spec, seq))
    torch_storage = torch.int8 if storage == "int8" else torch.float8_e4m3fn
    assert cache.pool.dtype == torch_storage and cache.scales.dtype == torch.float32
    for seq in (first, second):
        n, kv = cache.get(seq)
        exact = prefix_kv(cache.spec, seq)
        assert n == len(seq)
        assert ((kv - exact).abs() <= error_bound(exact, torch_storage)).all()
        assert not torch.equal(kv, exact)
    assert cache.stats().block_bytes == 4 * (2 * 2 * 2 * 8 * 1 + 2 * 2 * 2 * 4)  # int8/fp8 values + fp32 scales


def test_blocks_and_extended_slots_become_visible_only_after_their_bytes_are_written(monkeypatch):
    import kcaas_kernels

    cache = tiny_cache(block_size=4)
    short = tokens_of(6)
    cache.put(short, prefix_kv(cache.spec, short))
    writing, proceed = threading.Event(), threading.Event()
    real_write_kv = kcaas_kernels.write_kv

    def paused_write_kv(*args, **kwargs):  # the real kernel, run only once the test has looked
        writing.set()
        assert proceed.wait(10)
        return real_write_kv(*args, **kwargs)

    monkeypatch.setattr(kcaas_kernels, "write_kv", paused_write_kv)
    longer = short + [31, 32, 33, 34, 35]  # extends the partial block in place, then one new block
    writer = threading.Thread(target=cache.put, args=(longer, prefix_kv(cache.spec, longer)))
    writer.start()
    assert writing.wait(10)
    assert cache.lookup(longer) == 6  # neither the new slots of the partial block nor the new block show yet
    assert_get_exact(cache, longer, 6)
    proceed.set()
    writer.join()
    monkeypatch.setattr(kcaas_kernels, "write_kv", real_write_kv)
    assert cache.lookup(longer) == 11
    assert_get_exact(cache, longer, 11)


def test_a_put_that_fails_mid_write_publishes_nothing_and_holds_nothing(monkeypatch):
    import kcaas_kernels

    cache = tiny_cache(block_size=4)
    short = tokens_of(6)
    cache.put(short, prefix_kv(cache.spec, short))
    before = cache.stats()

    def failing_write_kv(*args, **kwargs):
        raise RuntimeError("device lost")

    longer = short + [41, 42, 43, 44, 45]
    with monkeypatch.context() as patch:
        patch.setattr(kcaas_kernels, "write_kv", failing_write_kv)
        with pytest.raises(RuntimeError, match="device lost"):
            cache.put(longer, prefix_kv(cache.spec, longer))
    cache.check_invariants()
    assert cache.stats().num_used_blocks == before.num_used_blocks
    assert cache.lookup(longer) == 6
    retry = cache.put(longer, prefix_kv(cache.spec, longer))
    assert retry.num_cow_copies == 0  # the failed put's claim on the partial block was released
    assert_get_exact(cache, longer, 11)


def test_get_into_a_reused_staging_buffer_is_exact_and_checks_the_buffer():
    cache = tiny_cache(block_size=4)
    seq = tokens_of(10)
    cache.put(seq, prefix_kv(cache.spec, seq))
    staging = torch.full((cache.spec.elements_per_token * 16,), float("nan"))
    n, kv = cache.get(seq + [1, 2], out=staging)
    assert n == 10 and torch.equal(kv, prefix_kv(cache.spec, seq))
    assert kv.data_ptr() == staging.data_ptr()  # a view into the caller's buffer: nothing allocated
    for bad in (staging[:10], staging.to(torch.float16), staging.view(-1, 2)[:, 0]):
        with pytest.raises(ValueError):
            cache.get(seq, out=bad)
