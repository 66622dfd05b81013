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

    loads = LayerwiseLoads(lambda: dp, lambda: (layers, paged), bs, spec.kv_bytes_per_token, 10.0, count)
    try:
        n = 6 * bs
        tokens, kv = random_tokens(n, seed=3)[0], random_kv(spec, n, seed=3)
        dp.put(tokens, kv)
        ids = np.asarray(tokens, dtype=np.int32)

        # every layer waited for: blocks 5, 2, 7, 9 hold tokens [2 bs, 6 bs) (the first 2 blocks: vLLM's own hit)
        loads.start([Load("r1", ids, 2 * bs, [5, 2, 7, 9])])
        for index in range(spec.num_layers):
            loads.wait_layer(index)
        assert loads.finish() == set()
        assert torch.equal(gather(layers, paged, [5, 2, 7, 9]), kv[:, :, 2 * bs :])
        assert stats["loaded_tokens"] == 4 * bs

        # the last layer never waited for: its blocks are failed, though the node had them all
        loads.start([Load("r2", ids, 2 * bs, [1, 3, 4, 6])])
        for index in range(spec.num_layers - 1):
            loads.wait_layer(index)
        assert loads.finish() == {1, 3, 4, 6}

        # the node holds 3 blocks of the 4 promised (the rest deleted after the promise): the last one fails
        dp.delete(np.concatenate([ids[: 5 * bs], np.arange(10_000, 10_000 + bs, dtype=np.int32)]))
        dp.put(tokens[: 5 * bs], kv[:, :, : 5 * bs])
        loads.start([Load("r3", ids, 2 * bs, [10, 11, 12, 13])])
        for index in range(spec.num_layers):
            loads.wait_layer(index)
        assert loads.finish() == {13}
        got, direct = dp.get(tokens[: 5 * bs])
        assert got == 5 * bs and torch.equal(direct, kv[:, :, : 5 * bs]), (direct - kv[:, :, : 5 * bs]).abs().max()
        assert torch.equal(gather(layers, paged, [10, 11, 12]), kv[:, :, 2 * bs : 5 * bs])
        assert stats["failed_tokens"] == 5 * bs
    finally:
        dp.close()
