"""PagedKVCache.put(tokens, kv, start=s): kv carries tokens[s:] only and is appended after the cached prefix — which
is never read back (a long put's frames cost what they carry, not the whole prefix again) — or refused with
PrefixNotCached, leaving the cache exactly as it was."""

import pytest
import torch

import kcaas_kernels
from gpu_node.engine.paged_cache import PrefixNotCached
from tests.gpu_node.kv_fixtures import check_consistent, prefix_kv, tiny_cache

TOKENS = list(range(200, 229))  # 29 tokens: seven full blocks of 4 and a partial tail of 1


@pytest.fixture
def no_pool_reads(monkeypatch):
    """Fail any read of the pool (a continuation must not read its prefix back)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a continued put read the pool")

    monkeypatch.setattr(kcaas_kernels, "read_kv", refuse)


@pytest.mark.parametrize("start", [8, 10, 28, 29])  # on a block boundary, inside a block, the tail, nothing new
def test_a_continuation_appends_after_the_cached_prefix_without_reading_it(start, monkeypatch):
    cache = tiny_cache()
    kv = prefix_kv(cache.spec, TOKENS)
    assert cache.put(TOKENS[:start], kv[:, :, :start]).num_cached_tokens == start
    reads = []
    real_read = kcaas_kernels.read_kv
    monkeypatch.setattr(kcaas_kernels, "read_kv", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    result = cache.put(TOKENS, kv[:, :, start:], start=start)
    assert reads == []
    assert result.num_cached_tokens == len(TOKENS) and result.num_written_tokens == len(TOKENS) - start
    monkeypatch.setattr(kcaas_kernels, "read_kv", real_read)
    n, got = cache.get(TOKENS)
    assert n == len(TOKENS) and torch.equal(got, kv)
    check_consistent(cache, holding=False)


def test_frames_of_a_long_put_each_carry_their_own_tokens_only(no_pool_reads):
    cache = tiny_cache()
    kv = prefix_kv(cache.spec, TOKENS)
    written = 0
    for start, end in [(0, 6), (6, 13), (13, 24), (24, 29)]:  # frame edges on and off block boundaries
        result = cache.put(TOKENS[:end], kv[:, :, start:end].clone(), start=start)
        assert result.num_cached_tokens == end
        written += result.num_written_tokens
    assert written == len(TOKENS)
    check_consistent(cache, holding=False)


def test_a_continuation_over_more_than_its_prefix_writes_only_what_is_missing():
    cache = tiny_cache()
    kv = prefix_kv(cache.spec, TOKENS)
    cache.put(TOKENS[:20], kv[:, :, :20])  # another writer got further than the continuation's start
    result = cache.put(TOKENS, kv[:, :, 8:], start=8)
    assert result.num_written_tokens == len(TOKENS) - 20
    n, got = cache.get(TOKENS)
    assert n == len(TOKENS) and torch.equal(got, kv)


@pytest.mark.parametrize("cached", [0, 5, 8])  # nothing, part of a block, whole blocks short of the start
def test_a_continuation_whose_prefix_is_not_cached_is_refused_and_changes_nothing(cached):
    cache = tiny_cache()
    kv = prefix_kv(cache.spec, TOKENS)
    if cached:
        cache.put(TOKENS[:cached], kv[:, :, :cached])
    before = cache.stats()
    with pytest.raises(PrefixNotCached) as refused:
        cache.put(TOKENS, kv[:, :, 12:], start=12)
    assert refused.value.num_cached == cached and refused.value.start == 12
    assert cache.stats() == before and cache.lookup(TOKENS) == cached
    check_consistent(cache, holding=False)
    # a refused continuation of a partial block left no claim on it: a later put can still extend it in place
    result = cache.put(TOKENS, kv)
    assert result.num_cached_tokens == len(TOKENS) and result.num_cow_copies == 0


def test_a_continuation_of_a_deleted_prefix_is_refused():
    cache = tiny_cache()
    kv = prefix_kv(cache.spec, TOKENS)
    cache.put(TOKENS[:16], kv[:, :, :16])
    cache.delete(TOKENS[:16])
    with pytest.raises(PrefixNotCached):
        cache.put(TOKENS, kv[:, :, 16:], start=16)
    check_consistent(cache, holding=False)


def test_start_and_kv_must_agree():
    cache = tiny_cache()
    kv = prefix_kv(cache.spec, TOKENS)
    with pytest.raises(ValueError):
        cache.put(TOKENS, kv, start=4)  # kv must hold tokens[4:] only
    with pytest.raises(ValueError):
        cache.put(TOKENS, kv[:, :, 30:], start=30)  # beyond the sequence
