"""A state machine over a tiny device pool with DRAM and SSD tiers: random puts, gets, holds, deletes, clears, warm
restarts and purges, with heavy prefix sharing so blocks move between tiers constantly.

Oracle: KV is a function of the prefix (kv_fixtures.prefix_kv), so whatever is served must equal that function
for the prefix claimed. And a model of what may be cached — every sequence put, minus what delete and clear
forgot — bounds every hit: a served prefix is a prefix of some sequence still in the model. A deleted prefix that
comes back from any tier (or from the SSD after a warm restart) breaks the bound.
"""

import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpu_node.engine.cache_state import CachePurged
from gpu_node.tiers.lower_tiers import LowerTiers
from gpu_node.tiers.ssd_store import SsdStore
from tests.gpu_node.kv_fixtures import check_consistent, prefix_kv, tiny_cache

sequences = st.lists(st.integers(0, 2), min_size=0, max_size=14)
HASH_KEY, DATA_KEY = b"p" * 32, b"d" * 32


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class TieredCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.directory = tempfile.mkdtemp(prefix="kcaas-tiers-machine-")
        self.stored: list[tuple[int, ...]] = []  # what may be cached: a superset of what is
        self.open_handles = []

    # ---- set-up ---------------------------------------------------------------------------------------------------
    @rule(
        block_size=st.sampled_from([1, 3, 4]),
        num_blocks=st.integers(2, 6),
        dram_blocks=st.integers(0, 3),
        ssd_blocks=st.sampled_from([0, 4, 12]),
    )
    @precondition(lambda self: self.cache is None)
    def attach(self, block_size, num_blocks, dram_blocks, ssd_blocks):
        self.shape = dict(block_size=block_size, num_blocks=num_blocks, dram_blocks=dram_blocks, ssd_blocks=ssd_blocks)
        self.cache = self._open()

    def _open(self):
        shape = self.shape
        cache = tiny_cache(
            block_size=shape["block_size"],
            num_blocks=shape["num_blocks"],
            key=HASH_KEY,
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
        )
        block_bytes = cache.spec.block_bytes
        store = None
        if shape["ssd_blocks"]:
            store = SsdStore(self.directory, DATA_KEY, shape["ssd_blocks"] * block_bytes, segment_bytes=4 * block_bytes)
        cache.attach_tiers(LowerTiers(shape["dram_blocks"] * block_bytes, store))
        return cache

    # ---- the oracle -----------------------------------------------------------------------------------------------
    def bound(self, tokens) -> int:
        return max((common_prefix(tokens, s) for s in self.stored), default=0)

    def check_served(self, tokens, n, kv) -> None:
        assert 0 <= n <= self.bound(tokens), "served a prefix nothing stored (or a forgotten one)"
        assert torch.equal(kv, prefix_kv(self.cache.spec, tokens[:n]))

    # ---- operations -----------------------------------------------------------------------------------------------
    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def put(self, tokens):
        result = self.cache.put(tokens, prefix_kv(self.cache.spec, tokens))
        self.stored.append(tuple(tokens))
        assert result.num_cached_tokens <= len(tokens)

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def get(self, tokens):
        looked_up = self.cache.lookup(tokens)
        assert looked_up <= self.bound(tokens)
        n, kv = self.cache.get(tokens)
        self.check_served(tokens, n, kv)

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None and len(self.open_handles) < 2)
    def acquire(self, tokens):
        handle = self.cache.acquire(tokens)
        self.open_handles.append((handle, tokens))

    @rule()
    @precondition(lambda self: self.open_handles)
    def read_and_release_oldest_handle(self):
        handle, tokens = self.open_handles.pop(0)
        kv = self.cache.read(handle)
        assert torch.equal(kv, prefix_kv(self.cache.spec, tokens[: handle.num_tokens]))
        handle.release()

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def delete(self, tokens):
        self.cache.delete(tokens)
        size = self.shape["block_size"]
        if len(tokens) >= size:  # the first block's subtree is gone from every tier
            self.stored = [s for s in self.stored if not (len(s) >= size and list(s[:size]) == tokens[:size])]
        assert self.cache.lookup(tokens) <= self.bound(tokens)

    @rule()
    @precondition(lambda self: self.cache is not None)
    def clear(self):
        self.cache.clear()
        self.stored = []
        assert self.cache.stats().num_cached_blocks == 0
        assert self.cache.tiers.resident_bytes() == {"dram": 0, "ssd": 0, "network": 0}

    @rule()
    @precondition(lambda self: self.cache is not None and not self.open_handles)
    def warm_restart(self):
        if self.cache.tiers.ssd is not None:
            self.cache.tiers.ssd.flush()
        self.cache.tiers.close()
        self.cache = self._open()  # device and DRAM are gone; the SSD is rescanned

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def purge(self, tokens):
        self.cache.wipe()
        assert not self.cache.pool.any()
        with pytest.raises(CachePurged):
            self.cache.get(tokens)
        for handle, _ in self.open_handles:
            with pytest.raises(CachePurged):
                self.cache.read(handle)
            handle.release()
        self.open_handles, self.stored = [], []
        self.cache = self._open()  # a new incarnation starts empty: nothing of the purged one is found

    @invariant()
    def consistent(self):
        if self.cache is not None:
            check_consistent(self.cache, holding=bool(self.open_handles))

    def teardown(self):
        for handle, _ in self.open_handles:
            handle.release()
        if self.cache is not None and self.cache.tiers is not None:
            self.cache.tiers.close()
        shutil.rmtree(self.directory, ignore_errors=True)


TieredCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTieredCacheMachine = TieredCacheMachine.TestCase
