"""A GET streamed layer by layer (DataPlaneClient.get's `progress`, over TLS from an agent process): whenever it
reports `layers`, every layer below holds its final KV in `out` already, the count only grows, and the answer is
the same as a plain GET's; a long answer in several frames reports only for its last one."""

from __future__ import annotations

import pytest
import torch

import kcaas
from tests.e2e.conftest import random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key

pytestmark = pytest.mark.django_db(transaction=True)


def test_reported_layers_hold_their_final_kv_before_the_get_returns(live_server, agent, model, pki):
    spec = spec_for(model)
    client = kcaas.Client(live_server.url, tenant_key())
    cache = client.attach("streamed", spec, {"device": 64 * spec.block_bytes}, timeout=30)
    dp = tenant_dataplane(client, cache, spec, pki)
    try:
        n = 40 * spec.block_size
        tokens, kv = random_tokens(n, seed=7)[0], random_kv(spec, n, seed=7)
        dp.put(tokens, kv)
        out = torch.full_like(kv, float("nan"))
        seen: list[int] = []

        def progress(layers: int, answered: int) -> None:
            assert answered == n and torch.equal(out[:layers], kv[:layers]), f"layers below {layers} not in yet"
            seen.append(layers)

        got, streamed = dp.get(tokens, out=out, progress=progress)
        assert got == n and torch.equal(streamed, kv) and streamed.data_ptr() == out.data_ptr()
        assert seen and seen == sorted(seen) and 0 < seen[-1] <= spec.num_layers
        assert len(set(seen)) > 1  # it streamed: some layers were reported before others

        small = kcaas.DataPlaneClient(
            cache.endpoint, kcaas.TokenSource(client, cache.id), cache.id, spec,
            ssl_context=dp._t.ssl_context, max_frame_bytes=1 << 20, timeout=10,
        )  # fmt: skip
        try:
            parts: list[int] = []
            out = torch.full_like(kv, float("nan"))
            got, streamed = small.get(tokens, out=out, progress=lambda layers, answered: parts.append(layers))
            assert got == n and torch.equal(streamed, kv) and parts == sorted(parts)
        finally:
            small.close()
        with pytest.raises(ValueError, match="progress needs an out"):
            dp.get(tokens, progress=lambda layers, answered: None)
    finally:
        dp.close()
