"""The vLLM connector's layer-pipelined loads (kcaas/connectors/vllm_loads.py) against an agent process over TLS,
into paged layers laid out as vLLM's CPU backend keeps them (no vLLM needed): layers waited for get the node's KV
in exactly the promised blocks; a load whose layers were not all waited for, or that the node answered short,
reports its unfilled blocks as failed (vLLM recomputes them) — never a block with some layers missing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kcaas
from kcaas.connectors.vllm_blocks import PagedLayout, gather
from kcaas.connectors.vllm_loads import LayerwiseLoads
from kcaas.connectors.vllm_worker import Load
from tests.e2e.conftest import random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_block_is_filled_in_every_layer_or_reported_failed(live_server, agent, model, pki):
    spec = spec_for(model)
    client = kcaas.Client(live_server.url, tenant_key())
    cache = client.attach("layerwise", spec, {"device": 64 * spec.block_bytes}, timeout=30)
    dp = tenant_dataplane(client, cache, spec, pki)
    bs = spec.block_size
    layers = [torch.full((16, spec.num_kv_heads, bs, 2 * spec.head_dim), float("nan")) for _ in range(spec.num_layers)]
    paged = PagedLayout.of("cpu", layers[0])
    stats: dict[str, float] = {}

    def count(**values: float) -> None:
        for name, value in values.items():
            stats[name] = stats.get(name, 0) + value

    loads = LayerwiseLoads(lambda: dp, lambda: (layers, paged), spec.kv_bytes_per_token, 10.0, count)
    try:
        n = 6 * bs
        tokens, kv = random_tokens(n, seed=3)[0], random_kv(spec, n, seed=3)
        dp.put(tokens, kv)
        ids = np.asarray(tokens, dtype=np.int32)

        # every layer waited for: blocks 5, 2, 7, 9 hold tokens [2 bs, 6 bs) (the first 2 blocks: vLLM's own hit)
        loads.start([Load("r1", ids, 2 * bs, [5, 2, 7, 9], bs)])
        for index in range(spec.num_layers):
            loads.wait_layer(index)
        assert loads.finish() == set()
        assert torch.equal(gather(layers, paged, [5, 2, 7, 9]), kv[:, :, 2 * bs :])
        assert stats["loaded_tokens"] == 4 * bs

        # the last layer never waited for: its blocks are failed, though the node had them all
        loads.start([Load("r2", ids, 2 * bs, [1, 3, 4, 6], bs)])
        for index in range(spec.num_layers - 1):
            loads.wait_layer(index)
        assert loads.finish() == {1, 3, 4, 6}

        # the node holds 3 blocks of the 4 promised (the rest deleted after the promise): the last one fails
        dp.delete(np.concatenate([ids[: 5 * bs], np.arange(10_000, 10_000 + bs, dtype=np.int32)]))
        dp.put(tokens[: 5 * bs], kv[:, :, : 5 * bs])
        loads.start([Load("r3", ids, 2 * bs, [10, 11, 12, 13], bs)])
        for index in range(spec.num_layers):
            loads.wait_layer(index)
        assert loads.finish() == {13}
        got, direct = dp.get(tokens[: 5 * bs])
        assert got == 5 * bs and torch.equal(direct, kv[:, :, : 5 * bs]), (direct - kv[:, :, : 5 * bs]).abs().max()
        assert torch.equal(gather(layers, paged, [10, 11, 12]), kv[:, :, 2 * bs : 5 * bs])
        assert stats["failed_tokens"] == 5 * bs
    finally:
        dp.close()


def test_a_hit_finer_than_vllms_blocks_fills_the_head_of_the_last_block(live_server, agent, model, pki):
    """Cache blocks of bs under vLLM blocks of 2 bs: a load of 5 cache blocks fills 2 vLLM blocks and the first half
    of a third, whose second half (vLLM's own tokens, written before this layer's load) stays; answered short, the
    block its first missing token is in fails, and the blocks before it are kept."""
    spec = spec_for(model)
    client = kcaas.Client(live_server.url, tenant_key())
    cache = client.attach("finer", spec, {"device": 64 * spec.block_bytes}, timeout=30)
    dp = tenant_dataplane(client, cache, spec, pki)
    bs, vbs = spec.block_size, 2 * spec.block_size
    with torch.inference_mode():  # as vLLM's blocks are: the loader thread writes them outside that mode
        layers = [torch.randn(16, spec.num_kv_heads, vbs, 2 * spec.head_dim) for _ in range(spec.num_layers)]
    paged = PagedLayout.of("cpu", layers[0])
    loads = LayerwiseLoads(lambda: dp, lambda: (layers, paged), spec.kv_bytes_per_token, 10.0, lambda **_: None)
    try:
        n = 5 * bs
        tokens, kv = random_tokens(n, seed=4)[0], random_kv(spec, n, seed=4)
        dp.put(tokens, kv)
        ids = np.asarray(tokens, dtype=np.int32)
        vllms_own = gather(layers, paged, [8])[:, :, bs:].clone()

        loads.start([Load("f1", ids, 0, [3, 5, 8], vbs)])
        for index in range(spec.num_layers):
            loads.wait_layer(index)
        assert loads.finish() == set()
        got = gather(layers, paged, [3, 5, 8])
        assert torch.equal(got[:, :, :n], kv)
        assert torch.equal(got[:, :, n:], vllms_own)

        dp.delete(np.concatenate([ids[: 3 * bs], np.arange(10_000, 10_000 + bs, dtype=np.int32)]))
        dp.put(tokens[: 3 * bs], kv[:, :, : 3 * bs])  # the node now holds 3 of the 5 cache blocks
        loads.start([Load("f2", ids, 0, [1, 2, 4], vbs)])
        for index in range(spec.num_layers):
            loads.wait_layer(index)
        assert loads.finish() == {2, 4}  # token 3 bs is in the second vLLM block: it and the third are recomputed
        assert torch.equal(gather(layers, paged, [1]), kv[:, :, :vbs])
    finally:
        dp.close()


def test_a_loads_blocks_and_what_it_fails_follow_its_tokens():
    load = Load("r", np.arange(5 * 16 + 256, dtype=np.int32), 256, [7, 8, 9], 32)  # 80 tokens after a 256 hit
    assert load.num_tokens == 80 and load.filled(10**6) == 80 and load.filled(100) == 0
    assert load.blocks_holding(80) == [7, 8, 9] and load.blocks_holding(64) == [7, 8] and load.blocks_holding(1) == [7]
    assert (
        load.missed(80) == [] and load.missed(64) == [9] and load.missed(48) == [8, 9] and load.missed(0) == [7, 8, 9]
    )
