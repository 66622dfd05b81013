"""PagedKVCache.kv_views: the zero-copy read of a held prefix must carry exactly the bytes get() returns, in the
API's layer-major order, for any [start, end) (mid-block, partial tail, whole), and only where the pool is plain host
memory in the engine dtype."""

import numpy as np
import pytest
import torch

from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache


def joined(views) -> bytes:
    return b"".join(bytes(v) for v in views)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_views_equal_get_for_odd_ranges(dtype):
    cache = tiny_cache(
        num_blocks=32, num_layers=3, num_kv_heads=3, head_dim=5, block_size=4, kv_dtype=dtype, storage_dtype=dtype
    )
    tokens = np.arange(300, 323, dtype=np.int32)  # 23 tokens: 5 full blocks and a partial tail of 3
    cache.put(tokens[:10], prefix_kv(cache.spec, tokens[:10]))  # fill some blocks first: ids are not in order
    cache.put(tokens, prefix_kv(cache.spec, tokens))
    expected = prefix_kv(cache.spec, tokens)
    with cache.acquire(tokens) as handle:
        assert handle.num_tokens == 23
        for start, end in [(0, 23), (0, 4), (3, 9), (5, 23), (22, 23), (8, 8), (4, 20)]:
            want = expected[:, :, start:end].contiguous().view(torch.uint8).numpy().tobytes()
            assert joined(cache.kv_views(handle, start, end)) == want, (start, end)


def test_quantized_pools_have_no_views():
    cache = tiny_cache(storage_dtype="int8")
    tokens = np.arange(8, dtype=np.int32)
    cache.put(tokens, prefix_kv(cache.spec, tokens))
    with cache.acquire(tokens) as handle:
        assert cache.kv_views(handle, 0, 8) is None
        assert cache.read(handle, 8).shape[2] == 8  # the copy path still reads it


def test_held_blocks_keep_their_bytes_while_other_puts_evict():
    cache = tiny_cache(num_blocks=6)
    first = np.arange(0, 8, dtype=np.int32)
    cache.put(first, prefix_kv(cache.spec, first))
    with cache.acquire(first) as handle:
        views = cache.kv_views(handle, 0, 8)
        before = joined(views)
        for seed in range(5):  # enough new puts to evict everything not held
            other = np.arange(1000 * (seed + 1), 1000 * (seed + 1) + 8, dtype=np.int32)
            cache.put(other, prefix_kv(cache.spec, other))
        assert joined(views) == before  # the held blocks were not reused under the views
