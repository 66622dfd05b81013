"""The vLLM connector's scheduler-side lookup (kcaas/connectors/vllm_lookup.py) against a real node over TLS, a
node that accepts connections and never answers (hung), and a node that stopped: an answer, or a miss within its
bound, and then misses at once for a back-off — the engine's scheduling loop never waits on a node twice."""

import socket
import time

import pytest

from kcaas.connectors.vllm_lookup import BoundedLookup
from kcaas.dataplane import DataPlaneClient
from tests.gpu_node.dataplane.conftest import CACHE_A
from tests.gpu_node.dataplane.test_requests_over_tls import TOKENS
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

LOOKUP_S = 0.05


def opener(endpoint: str, token: str, client_ctx):
    def open_client(timeout: float) -> DataPlaneClient:
        return DataPlaneClient(
            endpoint, token, CACHE_A, tiny_spec(), ssl_context=client_ctx, timeout=timeout, max_overloaded_retries=0
        )

    return open_client


def timed(call):
    started = time.monotonic()
    value = call()
    return value, time.monotonic() - started


def test_a_healthy_node_answers_then_a_stopped_one_is_a_miss_and_a_back_off(server, make_token, client_ctx, spec):
    token = make_token()
    with DataPlaneClient(server.endpoint, token, CACHE_A, spec, ssl_context=client_ctx) as dp:
        dp.put(TOKENS, prefix_kv(spec, TOKENS))
    lookup = BoundedLookup(opener(server.endpoint, token, client_ctx), LOOKUP_S, 5.0)
    try:
        assert lookup(TOKENS) == 22 and lookup(TOKENS[:9]) == 9 and not lookup.down
        server.stop()
        assert lookup(TOKENS) == 0 and lookup.down  # the connection broke: a miss
        missed, took = timed(lambda: lookup(TOKENS))
        assert missed == 0 and took < 0.1  # within the back-off: not even a connection attempt (a try waits >= 0.5 s)
    finally:
        lookup.close()


@pytest.fixture
def hung_node():
    """Accepts TCP connections and never says a word (a node stopped with SIGSTOP, a black-holed port)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def test_a_hung_node_costs_one_bounded_wait_per_back_off(hung_node, make_token, client_ctx):
    now = [0.0]
    opened, took = timed(
        lambda: BoundedLookup(opener(hung_node, make_token(), client_ctx), LOOKUP_S, 0.3, clock=lambda: now[0])
    )
    lookup = opened
    try:
        assert 0.25 <= took < 1.5  # the start-up connection gave up after its own timeout (0.3 s: the TLS handshake)
        missed, took = timed(lambda: lookup(TOKENS))
        assert missed == 0 and 0.45 <= took < 1.5 and lookup.down  # a reconnect bounded by max(10 x 50 ms, 0.5 s)
        missed, took = timed(lambda: lookup(TOKENS))
        assert missed == 0 and took < 0.1  # the back-off: no wait at all (a try waits >= 0.5 s)
        now[0] += 1.5  # past the first back-off (1 s): one more bounded try, then a doubled back-off
        assert lookup(TOKENS) == 0 and lookup.down
        now[0] += 1.5
        assert lookup.down  # 2 s this time
        now[0] += 1.0
        assert not lookup.down
    finally:
        lookup.close()
