"""Billing's read meter: a GET answer counts the tokens of KV it actually carried (kv_start..kv_end per sequence),
once it is sent; a put's prefix read-back and a continuation's already-sent prefix do not count."""

from __future__ import annotations

import time

import numpy as np

from gpu_node.dataplane.server import DataPlaneServer, server_tls_context
from tests.gpu_node.dataplane.conftest import CACHE_A, NODE_ID
from tests.gpu_node.dataplane.test_requests_over_tls import TOKENS, client_for
from tests.gpu_node.kv_fixtures import prefix_kv


def _served(registry, expected: int | None = None) -> int:
    """The served counter; with `expected`, once it reaches it (the node counts right after its send returns, which
    can be a moment after the client has read the answer)."""
    deadline = time.monotonic() + 5
    while True:
        served = registry.get(CACHE_A).engine.stats().num_served_tokens
        if expected is None or served >= expected or time.monotonic() > deadline:
            return served
        time.sleep(0.01)


def test_get_answers_count_the_tokens_of_kv_they_carried(server, make_token, client_ctx, spec, registry):
    with client_for(server, make_token(), client_ctx) as dp:
        dp.put(TOKENS, prefix_kv(spec, TOKENS))
        assert _served(registry) == 0
        assert dp.get(TOKENS)[0] == 22
        assert _served(registry, 22) == 22
        assert dp.get(np.concatenate([TOKENS[:13], np.array([7, 7], np.int32)]))[0] == 13
        assert dp.get(np.array([1, 2, 3], np.int32))[0] == 0  # a miss sends nothing
        assert dp.lookup(TOKENS) == 22  # a lookup sends no KV
    assert _served(registry, 35) == 35
    written = {e["cache_id"]: e for e in registry.usage_snapshot()}[CACHE_A]
    assert (written["tokens_served_total"], written["bytes_written_total"]) == (35, 22 * spec.storage_bytes_per_token)


def test_a_get_continued_across_frames_counts_each_token_once(registry, verifier, pki, client_ctx, make_token, spec):
    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        max_frame_bytes=16 * 1024,
        max_answer_bytes=16 * 1024,
    ).start()
    try:
        toks = np.arange(5000, 5150, dtype=np.int32)  # 150 tokens: more than one frame of KV
        with client_for(srv, make_token(), client_ctx) as dp:
            dp.put(toks, prefix_kv(spec, toks))  # sent in kv_start pieces: the node reads each prefix back
            assert dp.get(toks)[0] == 150
        assert _served(registry, 150) == 150
        stats = registry.get(CACHE_A).engine.stats()
        assert stats.num_hit_tokens > 150  # each continuation frame holds the whole prefix again
    finally:
        srv.stop()
