"""A state machine drives random puts, gets, holds, deletes and clears over a tiny pool with heavy prefix sharing.

The oracle needs no model of what is cached: KV is a function of the prefix (kv_fixtures.prefix_kv), so whatever the
cache serves must equal that function for the prefix it claims — any wrong block, slot, COW or eviction shows.
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from tests.gpu_node.kv_fixtures import check_consistent, prefix_kv, tiny_cache

# A three-token alphabet makes sequences share prefixes and partial blocks constantly.
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=14)


class CacheMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.cache = None
        self.open_handles = []

    @rule(block_size=st.sampled_from([1, 3, 4]), num_blocks=st.integers(2, 9))
    @precondition(lambda self: self.cache is None)
    def attach(self, block_size, num_blocks):
        self.cache = tiny_cache(block_size=block_size, num_blocks=num_blocks, num_layers=1, num_kv_heads=1, head_dim=2)

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def put(self, tokens):
        result = self.cache.put(tokens, prefix_kv(self.cache.spec, tokens))
        assert result.num_cached_tokens <= len(tokens)
        if not result.out_of_space:
            assert result.num_cached_tokens == len(tokens)
            assert self.cache.lookup(tokens) == len(tokens)

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def get(self, tokens):
        n, kv = self.cache.get(tokens)
        assert 0 <= n <= len(tokens)
        assert torch.equal(kv, prefix_kv(self.cache.spec, tokens[:n]))
        assert self.cache.lookup(tokens) == n

    @rule(target=handles, tokens=sequences)
    @precondition(lambda self: self.cache is not None and len(self.open_handles) < 3)
    def acquire(self, tokens):
        handle = self.cache.acquire(tokens)
        self.open_handles.append((handle, tokens[: handle.num_tokens]))
        return handle

    @rule()
    @precondition(lambda self: self.open_handles)
    def read_and_release_oldest_handle(self):
        from kcaas_kernels import read_kv

        handle, prefix = self.open_handles.pop(0)
        kv = read_kv(self.cache.pool, self.cache.scales, handle.slot_mapping(), out_dtype=torch.float32)
        assert torch.equal(kv, prefix_kv(self.cache.spec, prefix))  # held bytes survive eviction, delete, clear
        handle.release()

    @rule(tokens=sequences)
    @precondition(lambda self: self.cache is not None)
    def delete(self, tokens):
        self.cache.delete(tokens)

    @rule()
    @precondition(lambda self: self.cache is not None)
    def clear(self):
        self.cache.clear()
        assert self.cache.stats().num_cached_blocks == 0

    @invariant()
    def consistent(self):
        if self.cache is not None:
            check_consistent(self.cache, holding=bool(self.open_handles))

    def teardown(self):
        for handle, _ in self.open_handles:
            handle.release()


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
