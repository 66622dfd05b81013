"""A purge racing the data plane: a request to a purged engine answers not_found (an error frame, never zeros as
a hit), and a GET whose zero-copy answer is being sent is real KV, the purge waiting for it (real TLS server)."""

from __future__ import annotations

import threading

import pytest
import torch

from kcaas.dataplane import DataPlaneError
from kcaas.wire import ErrorCode
from tests.gpu_node.dataplane.conftest import CACHE_A
from tests.gpu_node.dataplane.test_requests_over_tls import TOKENS, client_for
from tests.gpu_node.kv_fixtures import prefix_kv
from tests.waiting import eventually


def test_requests_to_a_purged_engine_answer_not_found_and_the_connection_keeps_working(
    server, make_token, client_ctx, spec, registry
):
    kv = prefix_kv(spec, TOKENS)
    with client_for(server, make_token(), client_ctx) as dp:
        dp.put(TOKENS, kv)
        registry.get(CACHE_A).engine.wipe()  # purged under the session: the hosted entry is still registered
        for call in (lambda: dp.get(TOKENS), lambda: dp.lookup(TOKENS), lambda: dp.put(TOKENS, kv)):
            with pytest.raises(DataPlaneError) as error:
                call()
            assert error.value.code == ErrorCode.NOT_FOUND


def test_a_get_being_sent_when_the_purge_starts_is_real_kv(server, make_token, client_ctx, spec, registry):
    engine = registry.get(CACHE_A).engine
    kv = prefix_kv(spec, TOKENS)
    kv_views, sending, purge_started = engine.kv_views, threading.Event(), threading.Event()

    def views_then_purge(handle, start, end):  # the answer's views exist: a purge starts before they are sent
        views = kv_views(handle, start, end)
        threading.Thread(target=lambda: (purge_started.set(), engine.wipe())).start()
        assert purge_started.wait(5)
        sending.set()
        return views

    with client_for(server, make_token(), client_ctx) as dp:
        dp.put(TOKENS, kv)
        engine.kv_views = views_then_purge
        n, got = dp.get(TOKENS)
    assert sending.is_set() and n == len(TOKENS)
    assert torch.equal(got, kv)  # what was sent is the KV, not zeros
    assert eventually(lambda: engine.purged and not engine.pool.any(), timeout=10)  # then the purge zeroed it
