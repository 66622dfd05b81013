"""No plaintext left behind by the data plane (gpu_node/dataplane/connection.py): every buffer a tenant's KV or token
ids went through is zero once its request is answered (fresh buffers, temporaries) or once its connection closes (the
reused staging buffers); purging a tenant from the registry closes that tenant's connections, and only those,
before the purge returns; small answers are joined in a buffer that is zeroed after the write; TLS contexts cleanse
OpenSSL's record buffers. The buffers are observed through the tensors the engine is handed (views of them)."""

from __future__ import annotations

import socket
import ssl

import numpy as np
import pytest
import torch

from gpu_node.agent.registry import CacheRegistry
from gpu_node.dataplane.connection import Conn
from gpu_node.dataplane.io import OP_CLEANSE_PLAINTEXT, send_buffers
from gpu_node.dataplane.server import DataPlaneServer, server_tls_context
from gpu_node.dataplane.staging import StagingPool
from kcaas import wire
from kcaas.wire import Opcode
from tests.gpu_node.dataplane.conftest import CACHE_A, CACHE_B, EPOCH, NODE_ID, RawConn
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec
from tests.waiting import eventually

SPEC = tiny_spec()
BLOCK = SPEC.block_size


def is_zero(buf) -> bool:
    if isinstance(buf, torch.Tensor):
        return not buf.view(torch.uint8).any() if buf.is_contiguous() else not buf.contiguous().view(torch.uint8).any()
    return not np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8).any()


@pytest.fixture
def tenants_registry():
    """Tenant t-a's cache A and t-b's cache B (as the control plane provisions them: with their owner)."""
    registry = CacheRegistry(device_capacity_bytes=64 << 20, device="cpu")
    for cache_id, tenant in ((CACHE_A, "t-a"), (CACHE_B, "t-b")):
        registry.provision(
            cache_id=cache_id,
            spec=SPEC,
            capacity={"device": 1024 * SPEC.block_bytes},
            hash_key=cache_id.encode() * 4,
            epoch=EPOCH,
            tenant_id=tenant,
        )
    return registry


@pytest.fixture
def node(tenants_registry, verifier, pki):
    srv = DataPlaneServer(
        tenants_registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        frame_timeout=5.0,
        idle_timeout=10.0,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture
def connect(node, client_ctx):
    opened = []

    def make() -> RawConn:
        sock = client_ctx.wrap_socket(socket.create_connection(node.address, timeout=5), server_hostname="127.0.0.1")
        opened.append(RawConn(sock))
        return opened[-1]

    yield make
    for conn in opened:
        conn.close()


def record_puts(registry, cache_id: str) -> list:
    """The (tokens, kv) every put of the cache hands its engine: views of the data plane's buffers."""
    engine, seen = registry.get(cache_id).engine, []
    put = engine.put

    def recording_put(tokens, kv, **kwargs):
        seen.append((tokens, kv))
        return put(tokens, kv, **kwargs)

    engine.put = recording_put
    return seen


def put_frame(rid: int, tokens: np.ndarray, *, start: int = 0, cache_id: str = CACHE_A) -> bytes:
    kv = prefix_kv(SPEC, tokens)[:, :, start:].contiguous()
    return b"".join(
        bytes(b)
        for b in wire.encode_request(
            Opcode.PUT, rid, cache_id=cache_id, identity=SPEC, token_ids=[tokens], kv=[kv.numpy()], kv_start=[start]
        )
    )


def test_a_puts_buffers_are_zeroed_after_its_answer_or_at_close(node, connect, make_token, tenants_registry):
    seen = record_puts(tenants_registry, CACHE_A)
    conn = connect()
    assert conn.hello(make_token()).opcode == Opcode.OK
    small, large = np.arange(0, 2 * BLOCK, dtype=np.int32), np.arange(1000, 1000 + 600 * BLOCK, dtype=np.int32)
    conn.sock.sendall(put_frame(1, small) + put_frame(2, large))  # the large one is read ahead: its own staging
    assert [conn.read().opcode, conn.read().opcode] == [Opcode.OK, Opcode.OK]
    longer = np.arange(1000, 1000 + 602 * BLOCK, dtype=np.int32)
    conn.sock.sendall(put_frame(3, longer, start=len(large)))  # the suffix only, appended after the cached prefix
    assert conn.read().opcode == Opcode.OK
    (_, staged), (_, read_ahead), (_, suffix) = [(t, kv) for t, kv in seen]
    assert suffix.shape[2] == 2 * BLOCK  # no copy of the prefix was read back and joined
    assert all(eventually(lambda t=t: is_zero(t)) for t, _ in seen)  # token ids: zeroed once answered
    assert not is_zero(suffix)  # staging keeps the tenant's bytes for its next put while its connection lives
    conn.close()
    assert eventually(lambda: node.connection_count() == 0)
    assert is_zero(staged) and is_zero(read_ahead) and is_zero(suffix)  # ... and is zeroed when it closes
    assert tenants_registry.get(CACHE_A).engine.get(longer)[0] == len(longer)  # the engine kept its own copy


def test_a_gets_staging_and_copies_are_zeroed(verifier, pki, client_ctx, make_token, monkeypatch):
    """A quantized pool is read into the connection's GET staging (no zero-copy views); a range of it that does
    not start at 0 is copied before it is sent."""
    import gpu_node.dataplane.answers as dataplane  # where GET answers are built

    spec = tiny_spec(storage_dtype="int8")
    registry = CacheRegistry(device_capacity_bytes=64 << 20, device="cpu")
    registry.provision(
        cache_id=CACHE_A,
        spec=spec,
        capacity={"device": 64 * spec.block_bytes},
        hash_key=b"a" * 32,
        epoch=EPOCH,
        tenant_id="t-a",
    )
    tokens = np.arange(3 * BLOCK, dtype=np.int32)
    registry.get(CACHE_A).engine.put(tokens, prefix_kv(spec, tokens))
    sent = []
    monkeypatch.setattr(dataplane, "tensor_bytes", lambda t: (sent.append(t), dataplane_io_tensor_bytes(t))[1])
    srv = DataPlaneServer(
        registry, NODE_ID, verifier, server_tls_context(pki["cert"], pki["key"]), "127.0.0.1", 0
    ).start()
    try:
        conn = connected(srv, client_ctx, make_token())
        for rid, start in ((5, 0), (6, BLOCK)):
            conn.send(
                wire.encode_request(
                    Opcode.GET, rid, cache_id=CACHE_A, identity=spec, token_ids=[tokens], kv_start=[start]
                )
            )
            answer = conn.read()
            assert answer.opcode == Opcode.OK and answer.meta["kv_end"] == [len(tokens)]
        whole, copied = sent
        assert eventually(lambda: is_zero(copied))  # the range's copy: zeroed once its answer is sent
        conn.close()
        assert eventually(lambda: srv.connection_count() == 0)
        assert is_zero(whole)  # a view of the staging, zeroed at close
    finally:
        srv.stop()


def connected(srv, client_ctx, token) -> RawConn:
    """A TLS connection to `srv` that said HELLO with `token`."""
    sock = client_ctx.wrap_socket(socket.create_connection(srv.address, timeout=5), server_hostname="127.0.0.1")
    conn = RawConn(sock)
    assert conn.hello(token).opcode == Opcode.OK
    return conn


def dataplane_io_tensor_bytes(t):
    from gpu_node.dataplane.io import tensor_bytes

    return tensor_bytes(t)


def test_purging_a_tenant_closes_its_connections_only(node, connect, make_token, tenants_registry):
    seen = record_puts(tenants_registry, CACHE_A)
    mine, other = connect(), connect()
    assert mine.hello(make_token()).opcode == Opcode.OK
    assert other.hello(make_token(CACHE_B, sub="tenant:t-b"), CACHE_B).opcode == Opcode.OK
    tokens = np.arange(40 * BLOCK, dtype=np.int32)
    mine.sock.sendall(put_frame(1, tokens))
    assert mine.read().opcode == Opcode.OK
    ((_, staged),) = seen

    purged = tenants_registry.purge_tenant("t-a")
    assert [p["cache_id"] for p in purged] == [CACHE_A]
    assert is_zero(staged)  # zeroed before the purge returned (the node then answers the control plane)
    assert mine.closed(timeout=5)
    assert node.connection_count() == 1
    other.sock.sendall(put_frame(2, tokens, cache_id=CACHE_B))
    assert other.read().opcode == Opcode.OK  # the other tenant's connection goes on


def test_purge_listeners_run_after_unhosting_and_before_the_wipe(tenants_registry):
    engine = tenants_registry.get(CACHE_A).engine
    tokens = np.arange(4 * BLOCK, dtype=np.int32)
    engine.put(tokens, prefix_kv(SPEC, tokens))
    observed = []
    tenants_registry.add_purge_listener(
        lambda tenant: observed.append((tenant, tenants_registry.get(CACHE_A), bool(engine.pool.any())))
    )
    tenants_registry.purge_tenant("t-a")
    assert observed == [("t-a", None, True)]  # no longer hosted; the pool not wiped yet (no writer left after)
    assert not engine.pool.any()


class CapturingSocket:
    def __init__(self):
        self.written = []

    def sendall(self, data):
        self.written.append((data, bytes(data)))


def test_a_small_answer_is_joined_in_a_buffer_zeroed_after_the_write():
    sock = CapturingSocket()
    send_buffers(sock, [b"head", bytearray(b"kv bytes of a tenant")])
    ((buffer, content),) = sock.written
    assert content == b"headkv bytes of a tenant" and is_zero(buffer)


def test_tls_contexts_cleanse_plaintext(pki, registry, verifier):
    assert server_tls_context(pki["cert"], pki["key"]).options & OP_CLEANSE_PLAINTEXT
    given = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    given.load_cert_chain(pki["cert"], pki["key"])
    DataPlaneServer(registry, NODE_ID, verifier, given, "127.0.0.1", 0)
    assert given.options & OP_CLEANSE_PLAINTEXT  # whoever built the context (e.g. the node identity's)


def test_conn_scrub_zeroes_every_buffer_it_kept():
    pool = StagingPool(1 << 20)
    conn = Conn(sock=None, peer="test")
    tokens, kv = conn.put_buffers(1, 8, pool.lease(16, "tenant:t"))
    read_ahead_tokens, read_ahead = conn.put_buffers(2, 8, pool.lease(16, "tenant:t"))  # its own staging
    for buf in (tokens, kv, read_ahead_tokens, read_ahead):
        buf[:] = b"\x07" * len(buf)
    conn.frame_done(1, ())
    assert is_zero(tokens) and not is_zero(kv)  # the staging went back to the pool, still the tenant's
    conn.scratch = memoryview(bytearray(b"\x07" * 32))
    conn.get_staging = torch.ones(8)
    conn.temporaries.append(torch.ones(4))
    temporary = conn.temporaries[0]
    conn.scrub()
    assert is_zero(read_ahead_tokens) and is_zero(conn.scratch) and conn.leases == {}
    assert is_zero(conn.get_staging) and is_zero(temporary) and conn.fresh == {}
    assert pool.usage()[0] == 0  # every lease given back
    pool.scrub_tenant("tenant:t")  # what the server does once the connection is closed
    assert is_zero(kv) and is_zero(read_ahead)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_device_pool_joins_a_suffix_put_and_sends_a_range_through_host_copies(verifier, pki, client_ctx, make_token):
    """A CUDA pool: the suffix put's KV joins the prefix read back on the device; a GET range is read into the
    device staging and copied to host to be sent. The bytes are exact; the copies are zeroed once sent."""
    registry = CacheRegistry(device_capacity_bytes=64 << 20, device="cuda")
    registry.provision(
        cache_id=CACHE_A,
        spec=SPEC,
        capacity={"device": 64 * SPEC.block_bytes},
        hash_key=b"a" * 32,
        epoch=EPOCH,
        tenant_id="t-a",
    )
    srv = DataPlaneServer(
        registry, NODE_ID, verifier, server_tls_context(pki["cert"], pki["key"]), "127.0.0.1", 0
    ).start()
    try:
        conn = connected(srv, client_ctx, make_token())
        tokens = np.arange(3 * BLOCK, dtype=np.int32)
        conn.sock.sendall(put_frame(1, tokens[: 2 * BLOCK]) + put_frame(2, tokens, start=2 * BLOCK))
        assert [conn.read().opcode, conn.read().opcode] == [Opcode.OK, Opcode.OK]
        conn.send(
            wire.encode_request(Opcode.GET, 3, cache_id=CACHE_A, identity=SPEC, token_ids=[tokens], kv_start=[BLOCK])
        )
        answer = conn.read()
        assert answer.opcode == Opcode.OK and answer.meta["kv_end"] == [len(tokens)]
        expected = prefix_kv(SPEC, tokens)[:, :, BLOCK:].contiguous().numpy().tobytes()
        assert b"".join(bytes(view) for view in answer.payload) == expected
        conn.close()
        assert eventually(lambda: srv.connection_count() == 0)
    finally:
        srv.stop()
