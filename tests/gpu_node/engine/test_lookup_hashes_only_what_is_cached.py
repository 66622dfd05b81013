"""lookup hashes only as far as the cache holds the prompt, and answers exactly what the full-chain lookup answered.

The full-chain reference below is the lookup this module replaced, kept verbatim: hash every full block, binary
search the device index, match the partial tail, then the lower tiers' run after the device's full blocks.
"""

import random

import numpy as np
import pytest

from gpu_node.engine import block_hash
from gpu_node.tiers.lower_tiers import LowerTiers
from gpu_node.tiers.ssd_store import SsdStore
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache

BLOCK = 4
SLACK = 16  # "a small constant": lookup may hash up to this many blocks past the end of what is cached


@pytest.fixture
def hashed_blocks(monkeypatch):
    """Counts every block hash computed through gpu_node.engine.block_hash's chain functions (C or hashlib)."""
    count = [0]
    for name in ("chain_hashes", "chain_hashes_held"):
        original = getattr(block_hash, name, None)
        if original is None:
            continue

        def counting(*args, _original=original, _name=name):
            result = _original(*args)
            digests = result if _name == "chain_hashes" else result[0]
            count[0] += len(digests) // block_hash.HASH_NUM_BYTES
            return result

        monkeypatch.setattr(block_hash, name, counting)

    def hashed_by(fn):
        before = count[0]
        result = fn()
        return result, count[0] - before

    return hashed_by


def put(cache, tokens):
    assert cache.put(tokens, prefix_kv(cache.spec, tokens)).num_cached_tokens == len(tokens)


def reference_lookup(cache, tokens) -> int:
    """The full-chain lookup (before early exit): every hash first, then a binary search over them. White box: it
    reads the cache's state under its lock, as lookup does."""
    tokens = np.asarray(tokens, dtype=np.int32)
    state = cache._state
    chain = state.hasher.block_chain(tokens)
    with state.lock:
        index, blocks = state.blocks.cached_hash_to_block, state.blocks
        num_hashes = len(chain)
        if num_hashes == 0 or chain[num_hashes - 1] in index:
            num_full = num_hashes
        else:
            low, high = 0, num_hashes - 1
            while low < high:
                middle = (low + high + 1) // 2
                if chain[middle - 1] in index:
                    low = middle
                else:
                    high = middle - 1
            num_full = low
        num_tokens = num_full * cache.block_size
        _, tail_len = blocks.best_child(chain.parent(num_full), tokens[num_tokens : num_tokens + cache.block_size])
        num_tokens += tail_len
        if state.tiers is not None:
            start = num_tokens // cache.block_size
            num_tokens = max(num_tokens, (start + state.tiers.count_run(chain.hashes(start))) * cache.block_size)
    return num_tokens


def random_tokens(rng, n):
    return [rng.randrange(50_000) for _ in range(n)]


# ---- how much is hashed ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cached_blocks", [0, 1, 7, 8, 9, 50, 100, 199])
def test_a_miss_at_block_k_hashes_at_most_k_plus_a_constant_blocks(hashed_blocks, cached_blocks):
    cache = tiny_cache(block_size=BLOCK, num_blocks=512)
    rng = random.Random(cached_blocks)
    prompt = random_tokens(rng, 200 * BLOCK)
    if cached_blocks:
        put(cache, prompt[: cached_blocks * BLOCK])
    found, hashed = hashed_by = hashed_blocks(lambda: cache.lookup(prompt))
    assert found == cached_blocks * BLOCK, hashed_by
    assert cached_blocks < hashed <= cached_blocks + SLACK


def test_a_half_hit_hashes_about_half_and_a_full_hit_each_block_once(hashed_blocks):
    cache = tiny_cache(block_size=BLOCK, num_blocks=1024)
    rng = random.Random(1)
    full, half = random_tokens(rng, 256 * BLOCK), random_tokens(rng, 256 * BLOCK)
    put(cache, full)
    put(cache, half[: 128 * BLOCK])
    assert hashed_blocks(lambda: cache.lookup(full)) == (256 * BLOCK, 256)
    found, hashed = hashed_blocks(lambda: cache.lookup(half))
    assert found == 128 * BLOCK and hashed <= 128 + SLACK
    found, hashed = hashed_blocks(lambda: cache.lookup(full + [1, 2]))  # a partial tail is matched, never hashed
    assert found == 256 * BLOCK and hashed == 256


@pytest.mark.parametrize("on_device", [False, True])
def test_with_lower_tiers_hashing_goes_on_through_their_run_and_stops_after_it(hashed_blocks, on_device):
    """The prompt's first 60 blocks: all in DRAM, or its head on the device and the rest in DRAM."""
    pool = 80 if on_device else 64
    cache = tiny_cache(block_size=BLOCK, num_blocks=pool)
    cache.attach_tiers(LowerTiers(256 * cache.spec.block_bytes))
    rng = random.Random(2)
    prompt = random_tokens(rng, 200 * BLOCK)
    put(cache, prompt[: 60 * BLOCK])
    put(cache, random_tokens(rng, 64 * BLOCK))  # evicts the prompt's tail first (all of it from a 64-block pool)
    device_blocks = cache.stats().num_cached_blocks - 64
    assert device_blocks == (16 if on_device else 0)
    found, hashed = hashed_blocks(lambda: cache.lookup(prompt))
    assert found == 60 * BLOCK
    assert 60 < hashed <= 60 + SLACK  # on through DRAM's run, not to the end of the 200-block prompt
    assert found == reference_lookup(cache, prompt)


# ---- the same answers as the full-chain lookup -------------------------------------------------------------------
def _queries(rng, stored):
    """Prompts that share prefixes of stored sequences, then diverge, stop mid-block, or run on."""
    for tokens in rng.sample(stored, min(len(stored), 6)):
        cut = rng.randrange(len(tokens) + 1)
        yield tokens
        yield tokens[:cut]
        yield tokens[:cut] + [rng.randrange(3)] + tokens[cut + 1 :]
        yield tokens + [rng.randrange(3) for _ in range(rng.randrange(1, 2 * BLOCK))]
    yield [rng.randrange(3) for _ in range(rng.randrange(40))]
    yield []


def _check_against_reference(cache, rng, stored, num_rounds):
    for _ in range(num_rounds):
        op = rng.random()
        if op < 0.55 or not stored:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]  # a 3-token alphabet: heavy sharing
            cache.put(tokens, prefix_kv(cache.spec, tokens))
            stored.append(tokens)
        elif op < 0.7:
            cache.delete(rng.choice(stored)[: rng.randrange(1, 3 * BLOCK)])
        elif op < 0.85:
            cache.get(rng.choice(stored))  # promotes from the lower tiers, evicts
        else:
            tokens = rng.choice(stored)
            cache.put(tokens + [rng.randrange(3)], prefix_kv(cache.spec, tokens + [0])[:, :, : len(tokens) + 1])
        if cache.tiers is not None and cache.tiers.ssd is not None:
            cache.tiers.ssd.flush()  # its writer drops blocks over capacity on its own thread: let it settle first
        for query in _queries(rng, stored):
            assert cache.lookup(query) == reference_lookup(cache, query), query
        cache.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_lookup_equals_the_full_chain_lookup_on_the_device(seed):
    rng = random.Random(seed)
    _check_against_reference(tiny_cache(block_size=rng.choice([1, 3, 4]), num_blocks=12), rng, [], 60)


@pytest.mark.parametrize("seed", range(4))
def test_lookup_equals_the_full_chain_lookup_with_dram(seed):
    rng = random.Random(100 + seed)
    cache = tiny_cache(block_size=rng.choice([1, 3, 4]), num_blocks=6)
    cache.attach_tiers(LowerTiers(10 * cache.spec.block_bytes))
    _check_against_reference(cache, rng, [], 60)


@pytest.mark.parametrize("seed", range(2))
def test_lookup_equals_the_full_chain_lookup_with_dram_and_ssd(tmp_path, seed):
    rng = random.Random(200 + seed)
    cache = tiny_cache(block_size=rng.choice([3, 4]), num_blocks=5)
    block_bytes = cache.spec.block_bytes
    store = SsdStore(str(tmp_path), b"D" * 32, 40 * block_bytes, segment_bytes=8 * block_bytes)
    cache.attach_tiers(LowerTiers(3 * block_bytes, store))
    _check_against_reference(cache, rng, [], 50)
    cache.close()


def test_without_the_c_extension_hashlib_gives_the_same_answers(monkeypatch):
    monkeypatch.setattr(block_hash, "chain_hashes", block_hash.chain_hashes_python)
    monkeypatch.setattr(block_hash, "chain_hashes_held", block_hash.chain_hashes_held_python)
    monkeypatch.setattr(block_hash, "_int32_tokens_c", None)
    monkeypatch.setattr(block_hash, "_int32_nonnegative_c", None)
    rng = random.Random(300)
    cache = tiny_cache(block_size=3, num_blocks=6)
    cache.attach_tiers(LowerTiers(10 * cache.spec.block_bytes))
    _check_against_reference(cache, rng, [], 30)
    with pytest.raises(ValueError):
        cache.lookup(np.asarray([1, -1], dtype=np.int32))


def test_long_prompts_and_their_deletes_agree_with_the_full_chain_lookup():
    cache = tiny_cache(block_size=BLOCK, num_blocks=400)
    rng = random.Random(5)
    base = random_tokens(rng, 90 * BLOCK + 3)
    put(cache, base)
    put(cache, base[: 40 * BLOCK] + random_tokens(rng, 30 * BLOCK + 1))
    for cut in [0, 1, BLOCK, 17 * BLOCK, 40 * BLOCK - 1, 40 * BLOCK, 40 * BLOCK + 2, 63 * BLOCK, len(base)]:
        for query in (base[:cut], base[:cut] + [7] + base[cut + 1 :], base + [1] * cut):
            assert cache.lookup(query) == reference_lookup(cache, query)
    cache.delete(base[: 50 * BLOCK])  # forgets blocks 0.. and everything under them: both sequences
    for query in (base, base[: 40 * BLOCK]):
        assert cache.lookup(query) == reference_lookup(cache, query) == 0
    put(cache, base[: 20 * BLOCK + 2])
    assert cache.lookup(base) == reference_lookup(cache, base) == 20 * BLOCK + 2


def test_lookup_is_a_pure_query_and_refuses_bad_token_ids():
    cache = tiny_cache(block_size=BLOCK)
    put(cache, list(range(10)))
    before = cache.stats()
    assert cache.lookup(list(range(12))) == 10
    assert cache.stats() == before
    for bad in ([1, -1], [2**31], [[1, 2]], [1.5]):
        with pytest.raises(ValueError):
            cache.lookup(bad)
