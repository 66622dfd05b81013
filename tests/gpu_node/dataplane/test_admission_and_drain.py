"""Per-tenant admission, graceful drain and pipelined requests on the real TLS data plane (gpu_node/dataplane/server.py
+ gpu_node/dataplane/admission.py): one tenant's connections, requests in flight and staged bytes are bounded without
touching another tenant's; a drain answers what has started and closes the rest; pipelined puts never share a staging
buffer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_node.agent.metrics import NodeMetrics
from gpu_node.dataplane.admission import TenantLimits
from gpu_node.dataplane.server import DataPlaneServer, server_tls_context
from kcaas import wire
from kcaas.dataplane import DataPlaneClient
from kcaas.wire import ErrorCode, Opcode
from tests.gpu_node.dataplane.conftest import CACHE_A, CACHE_B, NODE_ID
from tests.gpu_node.kv_fixtures import prefix_kv
from tests.waiting import eventually

TOKENS = np.arange(2000, 2022, dtype=np.int32)


def put_frame(spec, rid: int, tokens=TOKENS, cache_id=CACHE_A) -> bytes:
    kv = prefix_kv(spec, tokens)
    return b"".join(
        bytes(b)
        for b in wire.encode_request(
            Opcode.PUT, rid, cache_id=cache_id, identity=spec, token_ids=[tokens], kv=[kv.numpy()]
        )
    )


@pytest.fixture
def limited_server(request, registry, verifier, pki):
    """A server with the limits the test names (indirect parametrization keeps each test's numbers visible)."""
    limits = request.param
    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        frame_timeout=5.0,
        idle_timeout=10.0,
        tenant_limits=limits,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture
def connect(limited_server, client_ctx):
    import socket

    from tests.gpu_node.dataplane.conftest import RawConn

    opened = []

    def make():
        host, port = limited_server.address
        sock = client_ctx.wrap_socket(socket.create_connection((host, port), timeout=5), server_hostname="127.0.0.1")
        opened.append(RawConn(sock))
        return opened[-1]

    yield make
    for conn in opened:
        conn.close()


def token_b(make_token):
    return make_token(CACHE_B, sub="tenant:t-b")


@pytest.mark.parametrize("limited_server", [TenantLimits(max_connections=2)], indirect=True)
def test_connections_per_tenant_bounded_other_tenant_unaffected(limited_server, connect, make_token):
    first, second, third = connect(), connect(), connect()
    assert first.hello(make_token()).opcode == Opcode.OK
    assert second.hello(make_token()).opcode == Opcode.OK
    refused = third.hello(make_token())
    assert refused.opcode == Opcode.ERROR and refused.meta["code"] == ErrorCode.OVERLOADED
    assert refused.meta["details"]["limit"] == "connections" and refused.meta["details"]["retry_after_ms"] > 0
    assert connect().hello(token_b(make_token), CACHE_B).opcode == Opcode.OK  # tenant B has its own allowance
    first.close()  # a closed connection gives its place back
    assert eventually(lambda: limited_server.admission.usage("tenant:t-a")[0] == 1)
    assert third.hello(make_token()).opcode == Opcode.OK


@pytest.mark.parametrize("limited_server", [TenantLimits(max_inflight_requests=1)], indirect=True)
def test_requests_in_flight_bounded_while_a_put_streams(limited_server, connect, make_token, spec, registry):
    slow, other, tenant_b = connect(), connect(), connect()
    for conn, token, cache in (
        (slow, make_token(), CACHE_A),
        (other, make_token(), CACHE_A),
        (tenant_b, token_b(make_token), CACHE_B),
    ):
        assert conn.hello(token, cache).opcode == Opcode.OK
    frame = put_frame(spec, rid=50)
    slow.sock.sendall(frame[: len(frame) - 64])  # metadata read: the put holds tenant A's only slot
    assert eventually(lambda: limited_server.admission.usage("tenant:t-a")[1] == 1), "the put never took its slot"
    refused = other.request(Opcode.LOOKUP, TOKENS)
    assert refused.opcode == Opcode.ERROR and refused.meta["code"] == ErrorCode.OVERLOADED
    assert refused.meta["details"]["limit"] == "requests"
    assert tenant_b.request(Opcode.LOOKUP, TOKENS, cache_id=CACHE_B).opcode == Opcode.OK  # B is not slowed down
    slow.sock.sendall(frame[len(frame) - 64 :])
    done = slow.read()
    assert done.opcode == Opcode.OK and done.meta["num_written"] == [len(TOKENS)]
    assert eventually(lambda: limited_server.admission.usage("tenant:t-a")[1:] == (0, 0))  # released after sending
    retried = other.request(Opcode.LOOKUP, TOKENS)  # the client's retry after the hint succeeds
    assert retried.opcode == Opcode.OK and retried.meta["num_cached"] == [len(TOKENS)]
    limited_server.admission.check_invariants()


@pytest.mark.parametrize("limited_server", [TenantLimits(max_inflight_bytes=1)], indirect=True)
def test_staged_bytes_bounded_but_a_lone_request_always_runs(limited_server, connect, make_token, spec, registry):
    slow, other = connect(), connect()
    assert slow.hello(make_token()).opcode == Opcode.OK and other.hello(make_token()).opcode == Opcode.OK
    frame = put_frame(spec, rid=60)
    slow.sock.sendall(frame[:-16])  # alone, a put larger than the whole budget is admitted
    staged = prefix_kv(spec, TOKENS).numpy().nbytes  # far over the budget of 1 byte
    assert eventually(lambda: limited_server.admission.usage("tenant:t-a")[1:] == (1, staged)), "not admitted alone"
    refused = other.request(Opcode.PUT, TOKENS[:8], kv=prefix_kv(spec, TOKENS[:8]).numpy())
    assert refused.opcode == Opcode.ERROR and refused.meta["details"]["limit"] == "bytes"
    slow.sock.sendall(frame[-16:])
    assert slow.read().opcode == Opcode.OK
    assert registry.get(CACHE_A).engine.lookup(TOKENS) == len(TOKENS)
    assert registry.get(CACHE_A).engine.lookup(np.concatenate([TOKENS[:8], [7]])) == 8  # from the first put only


def test_sdk_retries_overloaded_after_the_hint(registry, verifier, pki, client_ctx, make_token, spec):
    metrics = NodeMetrics(registry)
    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        metrics=metrics,
        tenant_limits=TenantLimits(max_inflight_requests=1),
    ).start()

    def refusals() -> float:
        return metrics.registry.get_sample_value("kcaas_dataplane_overloaded_total", {"limit": "requests"}) or 0.0

    holder = srv.admission.admit("tenant:t-a")  # the tenant's only slot, held until the SDK's put has been refused
    releaser = threading.Thread(target=lambda: eventually(lambda: refusals() >= 1) and holder.release())
    releaser.start()
    try:
        with DataPlaneClient(srv.endpoint, make_token(), CACHE_A, spec, ssl_context=client_ctx) as dp:
            assert dp.put(TOKENS, prefix_kv(spec, TOKENS))["num_written"] == len(TOKENS)  # refused, then retried
        assert refusals() >= 1, "the put was never refused: the retry was not exercised"
        assert eventually(lambda: srv.admission.usage("tenant:t-a")[1:] == (0, 0))
    finally:
        holder.release()
        releaser.join(30)
        srv.stop()


def test_pipelined_puts_each_keep_their_own_bytes(server, raw, make_token, spec, registry):
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK
    first, second = TOKENS[:8], np.arange(5000, 5008, dtype=np.int32)
    kv_second = prefix_kv(spec, second) + 1.0  # different bytes from the first put's
    frames = put_frame(spec, 70, first) + b"".join(
        bytes(b)
        for b in wire.encode_request(
            Opcode.PUT, 71, cache_id=CACHE_A, identity=spec, token_ids=[second], kv=[kv_second.numpy()]
        )
    )
    conn.sock.sendall(frames)  # both frames in one write: the second's metadata is read before the first is handled
    assert [conn.read().opcode, conn.read().opcode] == [Opcode.OK, Opcode.OK]
    engine = registry.get(CACHE_A).engine
    assert engine.get(first)[1].equal(prefix_kv(spec, first))
    assert engine.get(second)[1].equal(kv_second)


def test_drain_answers_started_requests_and_closes_idle_ones(registry, verifier, pki, client_ctx, make_token, spec):
    import socket

    from tests.gpu_node.dataplane.conftest import RawConn

    srv = DataPlaneServer(
        registry, NODE_ID, verifier, server_tls_context(pki["cert"], pki["key"]), "127.0.0.1", 0, frame_timeout=5.0
    ).start()

    def connect():
        sock = client_ctx.wrap_socket(socket.create_connection(srv.address, timeout=5), server_hostname="127.0.0.1")
        return RawConn(sock)

    busy, idle = connect(), connect()
    try:
        assert busy.hello(make_token()).opcode == Opcode.OK and idle.hello(make_token()).opcode == Opcode.OK
        frame = put_frame(spec, rid=80)
        busy.sock.sendall(frame[:-32])  # a put in flight when the drain starts
        assert eventually(lambda: srv.admission.usage("tenant:t-a")[1] == 1), "the put never started"
        result = {}
        drainer = threading.Thread(target=lambda: result.setdefault("busy", srv.drain(timeout=5.0)))
        drainer.start()
        assert idle.closed(timeout=3.0)  # nothing started there: closed at once
        with pytest.raises(OSError):
            socket.create_connection(srv.address, timeout=1).close()  # no new connections
        busy.sock.sendall(frame[-32:])
        answer = busy.read()
        assert answer.opcode == Opcode.OK and answer.meta["num_written"] == [len(TOKENS)]  # finished, not cut
        assert busy.closed(timeout=3.0)  # then closed
        drainer.join(5)
        assert not drainer.is_alive() and result["busy"] == 0  # the drain returned with nothing left busy
        assert registry.get(CACHE_A).engine.lookup(TOKENS) == len(TOKENS)
    finally:
        busy.close()
        idle.close()
        srv.stop()
