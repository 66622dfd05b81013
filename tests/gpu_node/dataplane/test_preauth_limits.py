"""What a client that never authenticates (or never sends its payload) can hold on a node, over real TLS 1.3 on
loopback: connections per source, unauthenticated connections node-wide and per source, the HELLO deadline, a
stalled payload, and the node-wide staging budget. Sources are distinct loopback addresses (127.0.0.x)."""

from __future__ import annotations

import socket
import ssl
import time

import numpy as np
import pytest

from gpu_node.dataplane.admission import NodeLimits
from gpu_node.dataplane.server import DataPlaneServer, server_tls_context
from kcaas import wire
from kcaas.wire import ErrorCode, Opcode
from tests.gpu_node.dataplane.conftest import CACHE_A, CACHE_B, NODE_ID, RawConn
from tests.gpu_node.kv_fixtures import prefix_kv
from tests.waiting import eventually

TOKENS = np.arange(3000, 3008, dtype=np.int32)


@pytest.fixture
def limited(request, registry, verifier, pki):
    limits = request.param
    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        node_limits=limits,
        idle_timeout=30.0,
        max_frame_bytes=min(wire.DEFAULT_MAX_FRAME_BYTES, limits.max_staged_bytes),
    ).start()
    yield srv
    srv.stop()


def tcp_from(server, source: str) -> socket.socket:
    return socket.create_connection(server.address, timeout=5, source_address=(source, 0))


def tls_from(server, client_ctx, source: str) -> RawConn:
    return RawConn(client_ctx.wrap_socket(tcp_from(server, source), server_hostname="127.0.0.1"))


def refused_before_handshake(server, client_ctx, source: str) -> bool:
    try:
        conn = tls_from(server, client_ctx, source)
    except (ssl.SSLError, ConnectionError, OSError):
        return True
    return conn.closed(timeout=2)


@pytest.mark.parametrize("limited", [NodeLimits(max_unauthenticated_per_source=3, hello_timeout=30)], indirect=True)
def test_idle_connections_from_one_source_cannot_lock_out_another(limited, client_ctx, make_token):
    idle = [tcp_from(limited, "127.0.0.2") for _ in range(3)]  # never even finish TLS
    assert eventually(lambda: limited.gate.counts("127.0.0.2") == (3, 3))
    assert refused_before_handshake(limited, client_ctx, "127.0.0.2")  # a fourth from that source
    tenant = tls_from(limited, client_ctx, "127.0.0.3")
    assert tenant.hello(make_token()).opcode == Opcode.OK  # another source is served
    assert limited.gate.counts("127.0.0.3") == (1, 0)  # authenticated: no longer counted as such
    for sock in idle:
        sock.close()


@pytest.mark.parametrize("limited", [NodeLimits(max_unauthenticated=2, hello_timeout=0.6)], indirect=True)
def test_a_connection_that_says_no_hello_in_time_is_closed_and_frees_its_place(limited, client_ctx, make_token):
    silent = [tls_from(limited, client_ctx, f"127.0.0.{i}") for i in (2, 3)]  # TLS done, then nothing
    assert refused_before_handshake(limited, client_ctx, "127.0.0.4")  # the node's unauthenticated budget is full
    assert all(conn.closed(timeout=5) for conn in silent)  # cut at the HELLO deadline
    assert eventually(lambda: limited.gate.counts("127.0.0.2") == (0, 0))
    late = tls_from(limited, client_ctx, "127.0.0.4")
    assert late.hello(make_token()).opcode == Opcode.OK
    time.sleep(0.8)  # past the HELLO deadline: an authenticated connection is not cut by it
    assert late.request(Opcode.LOOKUP, TOKENS).opcode == Opcode.OK


@pytest.mark.parametrize("limited", [NodeLimits(max_connections_per_source=2)], indirect=True)
def test_connections_per_source_are_bounded_even_when_authenticated(limited, client_ctx, make_token):
    first = [tls_from(limited, client_ctx, "127.0.0.5") for _ in range(2)]
    assert all(conn.hello(make_token()).opcode == Opcode.OK for conn in first)
    assert refused_before_handshake(limited, client_ctx, "127.0.0.5")
    assert tls_from(limited, client_ctx, "127.0.0.6").hello(make_token()).opcode == Opcode.OK


def put_header(spec, tokens, rid: int, cache_id: str = CACHE_A) -> bytes:
    """A whole PUT frame but for its KV: the header promises bytes that never come."""
    kv = prefix_kv(spec, tokens).numpy()
    frame = b"".join(
        bytes(b)
        for b in wire.encode_request(Opcode.PUT, rid, cache_id=cache_id, identity=spec, token_ids=[tokens], kv=[kv])
    )
    return frame[: len(frame) - kv.nbytes]


@pytest.mark.parametrize("limited", [NodeLimits(payload_stall_timeout=0.5, max_staged_bytes=64 << 10)], indirect=True)
def test_a_payload_that_stalls_is_cut_and_its_staging_returns_to_the_node(limited, client_ctx, make_token, spec):
    """A header-only PUT reserves the node's staging (64 KiB here) and pins it only until the stall timeout: another
    tenant's put is refused `overloaded` (node_bytes) meanwhile, and served once the stalled one is cut."""
    many = np.arange(9000, 9000 + (56 << 10) // spec.kv_bytes_per_token, dtype=np.int32)  # 56 KiB of KV
    pinner = tls_from(limited, client_ctx, "127.0.0.7")
    assert pinner.hello(make_token()).opcode == Opcode.OK
    pinner.sock.sendall(put_header(spec, many, 1))
    assert eventually(lambda: limited.staging.usage()[0] > 0)
    other = tls_from(limited, client_ctx, "127.0.0.8")
    assert other.hello(make_token(CACHE_B, sub="tenant:t-b"), cache_id=CACHE_B).opcode == Opcode.OK
    reply = other.request(Opcode.PUT, many[:300], cache_id=CACHE_B, kv=prefix_kv(spec, many[:300]).numpy())
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.OVERLOADED
    assert reply.meta["details"]["limit"] == "node_bytes"
    assert pinner.closed(timeout=5)  # no byte for 0.5 s inside a frame: cut
    assert eventually(lambda: limited.staging.usage()[0] == 0)
    reply = other.request(Opcode.PUT, many[:300], cache_id=CACHE_B, kv=prefix_kv(spec, many[:300]).numpy())
    assert reply.opcode == Opcode.OK
