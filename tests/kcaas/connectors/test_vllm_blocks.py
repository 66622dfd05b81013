"""Between vLLM's paged KV tensors and KCaaS's layout (kcaas/connectors/vllm_blocks.py), checked against how the
backends themselves read their tensors: the CPU backend views a layer as [blocks, heads, 2 * block_size, head_dim]
and chunks dim 2 into K and V (vllm/v1/attention/backends/cpu_attn.py); flash attention splits the last dim; the
MLA backends' `concat_and_cache_mla` writes each token's row as kv_c_normed then k_pe into the layer viewed as
[blocks, block_size, kv_lora_rank + qk_rope_head_dim] (the reference of vLLM's own kernel test, test_cache.py)."""

import pytest
import torch

from kcaas.connectors.vllm_blocks import (
    BACKEND_LAYOUTS,
    LayoutProbeError,
    PagedLayout,
    gather,
    loadable_tokens,
    savable_tokens,
    scatter,
)

NUM_BLOCKS, HEADS, BLOCK, DIM = 7, 3, 5, 6  # odd sizes: no two dims alike


def backend_k_v(kind: str, layer: torch.Tensor):
    """K and V, [blocks, heads, block_size, head_dim], as the backend's own attention code takes them."""
    if kind == "cpu":
        return layer.view(NUM_BLOCKS, HEADS, BLOCK * 2, DIM).chunk(2, dim=2)
    return layer.split(DIM, dim=-1)


def reference_kv(kind: str, layers, block_ids) -> torch.Tensor:
    """[layers, 2, tokens, heads, head_dim], token by token."""
    rows = []
    for layer in layers:
        k, v = backend_k_v(kind, layer)
        rows.append(
            torch.stack([torch.stack([part[b, :, t] for b in block_ids for t in range(BLOCK)]) for part in (k, v)])
        )
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["cpu", "concat"])
def test_gather_reads_what_the_backend_reads_and_scatter_writes_only_the_named_blocks(kind):
    torch.manual_seed(3)
    layers = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(2)]
    layout = PagedLayout.of(kind, layers[0])
    assert (layout.num_kv_heads, layout.block_size, layout.head_dim) == (HEADS, BLOCK, DIM)
    block_ids = [5, 1, 2]  # out of order and not contiguous, as vLLM's allocator hands them out
    kv = gather(layers, layout, block_ids)
    assert kv.shape == (2, 2, 3 * BLOCK, HEADS, DIM) and torch.equal(kv, reference_kv(kind, layers, block_ids))

    fresh = [torch.full_like(layer, float("nan")) for layer in layers]
    scatter(fresh, layout, [4, 0, 6], kv)
    assert torch.equal(reference_kv(kind, fresh, [4, 0, 6]), kv)  # the backend reads back exactly what was loaded
    for layer in fresh:
        assert torch.isnan(layer[[1, 2, 3, 5]]).all()  # no other block touched
    with pytest.raises(ValueError, match="ending in the last of 2 blocks"):
        scatter(fresh, layout, [0, 1], kv)  # 3 blocks of tokens for 2 blocks
    with pytest.raises(ValueError, match="ending in the last of 4 blocks"):
        scatter(fresh, layout, [0, 1, 3, 2], kv)  # a block no token of it lands in


@pytest.mark.parametrize("kind", ["cpu", "concat"])
@pytest.mark.parametrize("tail", [1, BLOCK - 1])
def test_tokens_ending_inside_a_block_fill_its_first_slots_and_leave_the_rest_as_they_were(kind, tail):
    """A hit finer than vLLM's blocks: the last block gets its first `tail` slots; vLLM's own tokens after them
    (written before the load in a layer-pipelined step) stay."""
    torch.manual_seed(5)
    layers = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(2)]
    layout = PagedLayout.of(kind, layers[0])
    source = gather(layers, layout, [5, 1])[:, :, : BLOCK + tail]  # a block and `tail` tokens of the next
    fresh = [torch.randn_like(layer) for layer in layers]
    before = [layer.clone() for layer in fresh]
    scatter(fresh, layout, [3, 0], source)
    got = reference_kv(kind, fresh, [3, 0])
    assert torch.equal(got[:, :, : BLOCK + tail], source)
    assert torch.equal(got[:, :, BLOCK + tail :], reference_kv(kind, before, [3, 0])[:, :, BLOCK + tail :])
    for layer, old in zip(fresh, before, strict=True):
        assert torch.equal(layer[[1, 2, 4, 5, 6]], old[[1, 2, 4, 5, 6]])  # no other block touched


RANK, ROPE = 6, 4  # a latent row 10 wide: stored as one head of 5


def concat_and_cache_mla(layer, kv_c, k_pe, slots):
    """vLLM's MLA cache write as its kernel test states it: the layer as [blocks, block_size, rank + rope], each
    slot's row kv_c then k_pe (k_pe: [tokens, 1, rope], as the attention layer passes it)."""
    rows = layer.view(layer.shape[0], layer.shape[2], RANK + ROPE)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, layer.shape[2])
        rows[block, offset, :RANK] = kv_c[token]
        rows[block, offset, RANK:] = k_pe[token, 0]


@pytest.mark.parametrize("backend", sorted(name for name, kind in BACKEND_LAYOUTS.items() if kind == "latent"))
def test_the_mla_backends_latent_rows_cross_unchanged_as_one_head_of_half_the_row(backend):
    layer = torch.full((NUM_BLOCKS, 1, BLOCK, RANK + ROPE), float("nan"))
    torch.manual_seed(11)
    kv_c, k_pe = torch.randn(3 * BLOCK, RANK), torch.randn(3 * BLOCK, 1, ROPE)
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in (6, 1, 3)])
    concat_and_cache_mla(layer, kv_c, k_pe, slots)
    rows = torch.cat([kv_c, k_pe[:, 0]], dim=-1)  # [tokens, 10]

    documented = PagedLayout.of(BACKEND_LAYOUTS[backend], layer)
    assert (documented.num_kv_heads, documented.block_size, documented.head_dim) == (1, BLOCK, (RANK + ROPE) // 2)
    kv = gather([layer], documented, [6, 1, 3])
    assert torch.equal(torch.cat([kv[0, 0, :, 0], kv[0, 1, :, 0]], dim=-1), rows)  # K plane | V plane = the row

    def write(paged, key, value, slot_mapping):  # the probe's CacheWrite, as kcaas.connectors.vllm adapts it
        row = torch.cat([key, value], dim=-1).flatten(1)
        concat_and_cache_mla(paged, row[:, :RANK], row[:, RANK:].unsqueeze(1), slot_mapping)

    probed = PagedLayout.probed("latent", layer, write)
    assert torch.equal(probed.offsets, documented.offsets)
    fresh = torch.full_like(layer, float("nan"))
    scatter([fresh], probed, [6, 1, 3], kv)
    assert torch.equal(fresh.nan_to_num(-7.0), layer.nan_to_num(-7.0))  # a load writes what the kernel wrote


def test_a_latent_layer_of_more_than_one_head_is_refused():
    with pytest.raises(ValueError, match="one row per token"):
        PagedLayout.of("latent", torch.zeros(2, 3, BLOCK, RANK + ROPE))


def test_a_tensor_that_is_no_paged_layer_is_refused():
    with pytest.raises(ValueError, match="paged KV layer"):
        PagedLayout.of("cpu", torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="unknown paged KV layout"):
        PagedLayout.of("flashinfer", torch.zeros(2, 3, 5, 8))


def test_only_whole_cache_blocks_load_and_the_last_prompt_token_is_always_computed():
    assert loadable_tokens(300, 400, 128) == 256  # a hit ending inside a block: its whole blocks
    assert loadable_tokens(2000, 2050, 16) == 2000  # 16-token cache blocks under 128-token vLLM blocks
    assert loadable_tokens(2050, 2050, 16) == 2048 and loadable_tokens(2048, 2048, 16) == 2032
    assert loadable_tokens(256, 256, 128) == 128  # the whole prompt cached: the last token is recomputed
    assert loadable_tokens(256, 257, 128) == 256
    assert loadable_tokens(100, 400, 128) == 0 and loadable_tokens(0, 1, 16) == 0
    assert savable_tokens(300, 128) == 256 and savable_tokens(127, 128) == 0 and savable_tokens(2050, 16) == 2048


def dim_major_k_writer(layer, key, value, slots):
    """A stand-in for the CPU backend's AVX kernel: inside each (block, head), K as [head_dim, block_size] and V
    token-major (what cpu_attn_reshape_and_cache does with the "vec" ISA)."""
    blocks, heads, bs, two_dims = layer.shape
    dim = two_dims // 2
    k_cache, v_cache = layer.view(blocks, heads, 2, bs, dim).unbind(2)
    k_flat = k_cache.reshape(blocks, heads, bs * dim)
    for token, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, bs)
        k_flat[block, :, offset + torch.arange(dim) * bs] = key[token]
        v_cache[block, :, offset] = value[token]


def test_a_probed_layout_reads_what_the_backend_wrote_where_its_view_would_not():
    layer = torch.full((NUM_BLOCKS, HEADS, BLOCK, 2 * DIM), float("nan"))
    probed = PagedLayout.probed("cpu", layer, dim_major_k_writer)
    assert probed.probed_from_backend and (probed.num_kv_heads, probed.block_size, probed.head_dim) == (
        HEADS,
        BLOCK,
        DIM,
    )
    torch.manual_seed(5)
    key, value = torch.randn(3 * BLOCK, HEADS, DIM), torch.randn(3 * BLOCK, HEADS, DIM)
    slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in (6, 1, 3)])
    dim_major_k_writer(layer, key, value, slots)
    kv = gather([layer], probed, [6, 1, 3])
    assert torch.equal(kv[0, 0], key) and torch.equal(kv[0, 1], value)
    viewed = gather([layer], PagedLayout.of("cpu", layer), [6, 1, 3])
    assert torch.equal(viewed[0, 1], value) and not torch.equal(viewed[0, 0], key)  # the view misreads K

    fresh = torch.full_like(layer, float("nan"))
    scatter([fresh], probed, [2, 0, 5], kv)  # what a load writes is what the kernel would have written
    reference = torch.full_like(layer, float("nan"))
    dim_major_k_writer(reference, key, value, torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in (2, 0, 5)]))
    assert torch.equal(fresh.nan_to_num(-7.0), reference.nan_to_num(-7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_probing_is_exact_in_every_engine_dtype(dtype):
    layer = torch.zeros(2, 4, 32, 2 * 64, dtype=dtype)  # 16,384 elements a block: three probe digits
    probed = PagedLayout.probed("cpu", layer, dim_major_k_writer)
    assert torch.equal(probed.offsets, PagedLayout.probed("cpu", layer.float(), dim_major_k_writer).offsets)


def test_a_write_the_probe_cannot_map_is_refused():
    layer = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM)

    def skips_v(paged, key, value, slots):
        dim_major_k_writer(paged, key, torch.full_like(value, -1.0), slots)

    def into_the_next_block(paged, key, value, slots):
        dim_major_k_writer(paged, key, value, (slots + BLOCK) % (paged.shape[0] * BLOCK))

    def rounds(paged, key, value, slots):
        dim_major_k_writer(paged, key * 1.001, value, slots)

    with pytest.raises(LayoutProbeError, match="unwritten or changed"):
        PagedLayout.probed("cpu", layer, skips_v)
    with pytest.raises(LayoutProbeError):
        PagedLayout.probed("cpu", layer, into_the_next_block)
    with pytest.raises(LayoutProbeError, match="unwritten or changed"):
        PagedLayout.probed("cpu", layer, rounds)


def scrambled(layout: PagedLayout) -> PagedLayout:
    """The same block shape with its elements placed by a random permutation: no strided view reaches them."""
    torch.manual_seed(13)
    offsets = torch.randperm(layout.block_elements).view(layout.offsets.shape)
    scrambled = PagedLayout(layout.kind, layout.num_kv_heads, layout.block_size, layout.head_dim, offsets)
    assert scrambled.planes is None
    return scrambled


@pytest.mark.parametrize("kind", ["cpu", "concat"])
def test_strided_copies_move_exactly_what_the_element_map_says(kind):
    """The known layouts take strided views (`planes`); any other permutation the element map: both agree, for
    whole blocks in runs and out of order, and for tokens ending inside the last block."""
    torch.manual_seed(17)
    layers = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(2)]
    fast = PagedLayout.of(kind, layers[0])
    slow = PagedLayout(fast.kind, fast.num_kv_heads, fast.block_size, fast.head_dim, fast.offsets)
    object.__setattr__(slow, "planes", None)  # the element map alone
    assert fast.planes is not None
    for block_ids in ([2, 3, 4], [5, 1, 2], [6]):
        assert torch.equal(gather(layers, fast, block_ids), gather(layers, slow, block_ids))
        for tokens in (len(block_ids) * BLOCK, len(block_ids) * BLOCK - 2):
            kv = torch.randn(2, 2, tokens, HEADS, DIM)
            a, b = [layer.clone() for layer in layers], [layer.clone() for layer in layers]
            scatter(a, fast, block_ids, kv)
            scatter(b, slow, block_ids, kv)
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (block_ids, tokens)
    other = scrambled(fast)
    kv = torch.randn(2, 2, 2 * BLOCK - 1, HEADS, DIM)
    scatter(layers, other, [3, 4], kv)
    assert torch.equal(gather(layers, other, [3, 4])[:, :, : 2 * BLOCK - 1], kv)
