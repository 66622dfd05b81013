"""The SDK data-plane client over real TLS 1.3: batch forms in one round trip, long gets landing at their offsets of
the caller's buffer (no join), long puts that resume when the node evicts their prefix between frames, and the
engine's identity checked once, at HELLO."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_node.dataplane.server import DataPlaneServer, server_tls_context
from kcaas import wire
from kcaas.dataplane import DataPlaneClient, DataPlaneError
from kcaas.wire import ErrorCode, Opcode
from tests.gpu_node.dataplane.conftest import CACHE_A, NODE_ID, RawConn
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec


def client_for(server, token, client_ctx, spec=None) -> DataPlaneClient:
    return DataPlaneClient(server.endpoint, token, CACHE_A, spec or tiny_spec(), ssl_context=client_ctx)


def count_requests(server) -> list:
    """The data requests the server handles from now on: (opcode, number of sequences)."""
    seen, handle = [], server._handle

    def counting(conn, frame):
        if frame.opcode in wire.DATA_OPS:
            seen.append((frame.opcode, len(frame.meta.get("num_tokens", ()))))
        return handle(conn, frame)

    server._handle = counting
    return seen


@pytest.fixture
def small_frames(registry, verifier, pki):
    """A node whose frames hold 16 KiB: a 150-token sequence (128 B of KV per token) needs several."""
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
    yield srv
    srv.stop()


def sequences(count: int, length: int, base: int = 7000) -> list[np.ndarray]:
    return [np.arange(base + i * 1000, base + i * 1000 + length, dtype=np.int32) for i in range(count)]


def test_batches_take_one_round_trip_and_answer_per_sequence(server, make_token, client_ctx, spec):
    seqs = sequences(5, 9)
    kvs = [prefix_kv(spec, s) for s in seqs]
    seen = count_requests(server)
    with client_for(server, make_token(), client_ctx) as dp:
        results = dp.put_batch(list(zip(seqs[:4], kvs[:4])))
        assert [r["num_written"] for r in results] == [9, 9, 9, 9]
        assert dp.lookup_batch(seqs) == [9, 9, 9, 9, 0]
        outs = [torch.empty(spec.elements_per_token * 9, dtype=kvs[0].dtype) for _ in seqs]
        got = dp.get_batch(seqs, outs=outs, starts=[0, 3, 0, 9, 0])
        assert [n for n, _ in got] == [9, 9, 9, 9, 0]
        assert torch.equal(got[0][1], kvs[0]) and torch.equal(got[1][1], kvs[1][:, :, 3:])
        assert torch.equal(got[2][1], kvs[2]) and got[3][1].shape[2] == 0 and got[4][1].shape[2] == 0
        assert got[0][1].data_ptr() == outs[0].data_ptr()  # straight into the caller's buffers
        assert dp.delete_batch(seqs[:2])[0] >= 1
        assert dp.lookup_batch(seqs[:3]) == [0, 0, 9]
    assert seen == [
        (Opcode.PUT_BATCH, 4),
        (Opcode.LOOKUP_BATCH, 5),
        (Opcode.GET_BATCH, 5),
        (Opcode.DELETE_BATCH, 2),
        (Opcode.LOOKUP_BATCH, 3),
    ]


def test_a_long_get_lands_at_its_offsets_of_the_callers_buffer(small_frames, make_token, client_ctx, spec):
    toks = sequences(1, 150)[0]
    kv = prefix_kv(spec, toks)
    seen = count_requests(small_frames)
    with client_for(small_frames, make_token(), client_ctx) as dp:
        assert dp.put(toks, kv)["num_cached"] == 150
        puts = len(seen)
        assert puts > 1 and all(op == Opcode.PUT for op, _ in seen)  # several frames, one sequence
        staging = torch.full((spec.elements_per_token * 200,), float("nan"), dtype=kv.dtype)
        n, got = dp.get(toks, out=staging)
        assert len(seen) - puts > 1  # the answer came in parts ...
        assert n == 150 and torch.equal(got, kv)
        assert got.data_ptr() == staging.data_ptr() and got.is_contiguous()  # ... each at its offset: no join
        n, got = dp.get(toks, start=20)  # without a buffer: one allocated for the whole answer
        assert n == 150 and torch.equal(got, kv[:, :, 20:]) and got.is_contiguous()


def test_a_get_answered_from_the_pool_is_one_frame_however_long(registry, verifier, pki, client_ctx, make_token, spec):
    """Requests stay within max_frame_bytes (a put's KV is staged), but a GET answered from the pool itself stages
    nothing: a client that offers at HELLO gets it in one frame up to max_answer_bytes."""
    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        max_frame_bytes=16 * 1024,
        max_answer_bytes=1 << 20,
    ).start()
    try:
        toks = sequences(1, 150)[0]
        kv = prefix_kv(spec, toks)
        seen = count_requests(srv)
        with client_for(srv, make_token(), client_ctx) as dp:
            dp.put(toks, kv)
            puts = len(seen)
            assert puts > 1  # 19 KiB of KV: more than one 16 KiB request frame
            n, got = dp.get(toks)
            assert dp.hello.max_answer_bytes == 1 << 20
        assert len(seen) - puts == 1 and n == 150 and torch.equal(got, kv)  # one answer for all of it
    finally:
        srv.stop()


def test_a_batch_larger_than_a_frame_is_split_and_still_exact(small_frames, make_token, client_ctx, spec):
    seqs = sequences(6, 40)  # 6 x 40 tokens x 128 B: more than one 16 KiB frame
    kvs = [prefix_kv(spec, s) for s in seqs]
    with client_for(small_frames, make_token(), client_ctx) as dp:
        assert [r["num_cached"] for r in dp.put_batch(list(zip(seqs, kvs)))] == [40] * 6
        got = dp.get_batch(seqs)
        assert all(n == 40 and torch.equal(kv, want) for (n, kv), want in zip(got, kvs))


def test_a_long_put_resumes_when_the_node_loses_its_prefix_between_frames(
    small_frames, make_token, client_ctx, spec, registry
):
    toks = sequences(1, 150)[0]
    kv = prefix_kv(spec, toks)
    engine = registry.get(CACHE_A).engine
    put, calls = engine.put, []

    def evicting_put(tokens, kv_part, **kwargs):
        calls.append(kwargs.get("start", 0))
        if len(calls) == 2:
            engine.delete(tokens[:4])  # evicted under the put, between its first and second frames
        return put(tokens, kv_part, **kwargs)

    engine.put = evicting_put
    with client_for(small_frames, make_token(), client_ctx) as dp:
        result = dp.put(toks, kv)
        assert result["num_cached"] == 150
        n, got = dp.get(toks)
    assert calls.count(0) == 2  # the first frame again, once the node said its prefix was gone
    assert n == 150 and torch.equal(got, kv)


def test_the_identity_is_checked_once_at_hello_and_requests_may_leave_it_out(server, make_token, client_ctx, spec):
    seen, handle = [], server._handle

    def recording(conn, frame):
        seen.append(frame.meta)
        return handle(conn, frame)

    server._handle = recording
    with client_for(server, make_token(), client_ctx) as dp:
        dp.lookup(np.arange(5, dtype=np.int32))
    assert "identity" in seen[0] and all("identity" not in meta for meta in seen[1:])
    other = tiny_spec(num_kv_heads=4)
    with pytest.raises(Exception) as refused:  # the client's own check, or the node's at HELLO
        client_for(server, make_token(), client_ctx, spec=other).lookup(np.arange(5, dtype=np.int32))
    assert getattr(refused.value, "code", "") == ErrorCode.IDENTITY_MISMATCH or "num_kv_heads" in str(refused.value)


def test_the_node_refuses_a_hello_whose_identity_differs_and_a_request_without_any(server, make_token, pki):
    import socket
    import ssl

    ctx = ssl.create_default_context(cafile=pki["ca"])
    raw = RawConn(ctx.wrap_socket(socket.create_connection(server.address), server_hostname="127.0.0.1"))
    raw.send(wire.encode_hello(1, cache_id=CACHE_A, token=make_token(), identity=tiny_spec(head_dim=8)))
    reply = raw.read()
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.IDENTITY_MISMATCH
    assert "head_dim" in reply.meta["details"]["fields"]
    raw.send(wire.encode_hello(2, cache_id=CACHE_A, token=make_token()))  # no identity: requests must carry it
    assert raw.read().opcode == Opcode.OK
    raw.send(
        wire.encode_request(
            Opcode.LOOKUP, 3, cache_id=CACHE_A, identity=None, session_identity=tiny_spec(), token_ids=[[1, 2, 3]]
        )
    )
    reply = raw.read()
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.BAD_REQUEST
    assert "identity" in reply.meta["message"]
    raw.close()


def test_a_node_that_refuses_identity_in_hello_gets_it_with_every_request(
    server, make_token, client_ctx, spec, monkeypatch
):
    """Older nodes refuse the field: the client says HELLO without it and sends the identity per request."""
    import gpu_node.dataplane.server as node_module

    parse_hello = wire.parse_hello

    def old_parse_hello(frame):
        if "identity" in frame.meta:
            raise wire.ProtocolError(ErrorCode.BAD_REQUEST, "unknown metadata fields ['identity']")
        return parse_hello(frame)

    monkeypatch.setattr(node_module.wire, "parse_hello", old_parse_hello)
    kv = prefix_kv(spec, np.arange(9, dtype=np.int32))
    with client_for(server, make_token(), client_ctx) as dp:
        dp.put(np.arange(9, dtype=np.int32), kv)
        n, got = dp.get(np.arange(9, dtype=np.int32))
    assert n == 9 and torch.equal(got, kv)
    with pytest.raises(DataPlaneError):  # a refusal of anything else is not mistaken for that
        client_for(server, make_token(aud="cache:elsewhere"), client_ctx).lookup([1, 2])
