"""Between vLLM's paged KV tensors and KCaaS's layout (kcaas/connectors/vllm_blocks.py), checked against how the
backends themselves read their tensors: the CPU backend views a layer as [blocks, heads, 2 * block_size, head_dim]
and chunks dim 2 into K and V (vllm/v1/attention/backends/cpu_attn.py); flash attention splits the last dim."""

import pytest
import torch

from kcaas.connectors.vllm_blocks import PagedLayout, gather, loadable_tokens, savable_tokens, scatter

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
    with pytest.raises(ValueError, match="to fill 2 blocks"):
        scatter(fresh, layout, [0, 1], kv)


def test_a_tensor_that_is_no_paged_layer_is_refused():
    with pytest.raises(ValueError, match="paged KV layer"):
        PagedLayout.of("cpu", torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="unknown paged KV layout"):
        PagedLayout.of("flashinfer", torch.zeros(2, 3, 5, 8))


def test_only_whole_blocks_load_and_the_last_prompt_token_is_always_computed():
    assert loadable_tokens(300, 400, 128) == 256  # a hit ending inside a block: its whole blocks
    assert loadable_tokens(256, 256, 128) == 128  # the whole prompt cached: the last token is recomputed
    assert loadable_tokens(256, 257, 128) == 256
    assert loadable_tokens(100, 400, 128) == 0 and loadable_tokens(0, 1, 16) == 0
    assert savable_tokens(300, 128) == 256 and savable_tokens(127, 128) == 0
