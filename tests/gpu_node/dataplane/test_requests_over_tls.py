"""The data plane end to end over real TLS 1.3 on loopback: SDK client <-> DataPlaneServer <-> PagedKVCache."""

from __future__ import annotations

import socket
import ssl
import struct
import time

import numpy as np
import pytest
import torch

from kcaas import wire
from kcaas.dataplane import DataPlaneClient, DataPlaneError
from kcaas.wire import ErrorCode, Opcode
from tests.gpu_node.dataplane.conftest import CACHE_A, CACHE_B, EPOCH, NODE_ID, RawConn
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec
from tests.waiting import eventually

TOKENS = np.arange(1000, 1022, dtype=np.int32)  # 22 tokens: 5 full blocks of 4 and a partial tail


def client_for(server, token, client_ctx, cache_id=CACHE_A, spec=None, **kw) -> DataPlaneClient:
    return DataPlaneClient(server.endpoint, token, cache_id, spec or tiny_spec(), ssl_context=client_ctx, **kw)


def lookup_a(registry, tokens=TOKENS) -> int:
    return registry.get(CACHE_A).engine.lookup(tokens)


# ---- the happy path ------------------------------------------------------------------------------------------------
def test_put_get_lookup_delete_bit_exact_over_tls(server, make_token, client_ctx, spec, registry):
    kv = prefix_kv(spec, TOKENS)
    with client_for(server, make_token(), client_ctx) as dp:
        assert dp.lookup(TOKENS) == 0
        result = dp.put(TOKENS, kv)
        assert result == {"num_cached": 22, "num_written": 22, "out_of_space": False}
        assert dp.lookup(TOKENS) == 22
        assert dp.lookup(TOKENS[:9]) == 9
        n, got = dp.get(TOKENS)
        assert n == 22 and got.dtype == kv.dtype and torch.equal(got, kv)  # bit-exact
        n, got = dp.get(np.concatenate([TOKENS[:13], np.array([7, 7, 7], np.int32)]))  # longest prefix
        assert n == 13 and torch.equal(got, kv[:, :, :13])
        staging = torch.full((spec.elements_per_token * 30,), float("nan"), dtype=kv.dtype)
        n, got = dp.get(TOKENS, out=staging)  # received straight into the caller's staging buffer
        assert n == 22 and torch.equal(got, kv) and got.data_ptr() == staging.data_ptr()
        with pytest.raises(ValueError):
            dp.get(TOKENS, out=staging[:10])
        assert dp.put(TOKENS, kv)["num_written"] == 0  # deduplicated
        assert dp.delete(TOKENS[:8]) >= 1
        assert dp.lookup(TOKENS) == 0
        n, got = dp.get(TOKENS)
        assert n == 0 and got.shape[2] == 0
    assert lookup_a(registry) == 0


def test_get_and_put_from_a_start_send_only_the_tokens_the_caller_lacks(server, make_token, client_ctx, spec, registry):
    """What a vLLM connector does: a GET of only the tokens beyond the engine's own hit, a PUT of only the tokens
    beyond what the cache holds; a PUT whose prefix the cache lost is refused, never stored half."""
    kv = prefix_kv(spec, TOKENS)
    with client_for(server, make_token(), client_ctx) as dp:
        assert dp.put(TOKENS[:8], kv[:, :, :8])["num_cached"] == 8
        result = dp.put(TOKENS, kv[:, :, 8:], start=8)  # the suffix only
        assert result["num_cached"] == 22 and result["num_written"] == 14
        n, got = dp.get(TOKENS, start=12)
        assert n == 22 and torch.equal(got, kv[:, :, 12:])
        staging = torch.empty((spec.elements_per_token * 10,), dtype=kv.dtype)
        n, got = dp.get(TOKENS, start=12, out=staging)
        assert n == 22 and torch.equal(got, kv[:, :, 12:]) and got.data_ptr() == staging.data_ptr()
        n, got = dp.get(np.concatenate([TOKENS[:9], np.array([7, 7], np.int32)]), start=4)
        assert n == 9 and torch.equal(got, kv[:, :, 4:9])
        assert dp.delete(TOKENS[:4]) >= 1
        n, got = dp.get(TOKENS, start=8)  # not even the first 8 are cached now
        assert n == 0 and got.shape[2] == 0
        with pytest.raises(DataPlaneError) as refused:
            dp.put(TOKENS, kv[:, :, 8:], start=8)
        assert refused.value.code == "prefix_not_cached"
        assert dp.lookup(TOKENS) == 0
        with pytest.raises(ValueError):
            dp.put(TOKENS, kv, start=8)  # kv must hold tokens[8:] only
        with pytest.raises(ValueError):
            dp.get(TOKENS, start=23)


def test_fp16_and_connection_reuse(server, make_token, client_ctx, registry):
    spec16 = tiny_spec(kv_dtype="float16", storage_dtype="float16")
    registry.provision(
        cache_id="c_fp16", spec=spec16, capacity={"device": 64 * spec16.block_bytes}, hash_key=b"h" * 32, epoch=EPOCH
    )
    dp = client_for(server, make_token("c_fp16"), client_ctx, cache_id="c_fp16", spec=spec16)
    for i in range(5):
        toks = np.arange(i * 100, i * 100 + 9, dtype=np.int32)
        kv = prefix_kv(spec16, toks)
        dp.put(toks, kv)
        n, got = dp.get(toks)
        assert n == 9 and torch.equal(got, kv)
    assert server.connection_count() == 1  # one connection, one handshake for every request
    dp.close()


def test_long_sequences_split_across_frames(registry, verifier, pki, client_ctx, make_token, spec):
    """A node with a tiny frame limit: put is sent in kv_start pieces and get is continued from kv_end."""
    from gpu_node.dataplane.server import DataPlaneServer, server_tls_context

    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        max_frame_bytes=16 * 1024,
    ).start()
    try:
        toks = np.arange(5000, 5000 + 150, dtype=np.int32)  # 150 tokens x 128 B of KV = 19 KiB > one frame
        kv = prefix_kv(spec, toks)
        with client_for(srv, make_token(), client_ctx) as dp:
            assert dp.put(toks, kv)["num_cached"] == 150
            n, got = dp.get(toks)
            assert n == 150 and torch.equal(got, kv)
    finally:
        srv.stop()


def test_uds_path_same_protocol_and_auth(server, make_token, spec, registry):
    kv = prefix_kv(spec, TOKENS)
    with DataPlaneClient(None, make_token(), CACHE_A, spec, uds_path=server.uds_path) as dp:
        dp.put(TOKENS, kv)
        n, got = dp.get(TOKENS)
        assert n == 22 and torch.equal(got, kv)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.uds_path)
    conn = RawConn(s)
    reply = conn.hello(make_token(exp=int(time.time()) - 60))
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.TOKEN_EXPIRED
    reply = conn.request(Opcode.GET, TOKENS)
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.UNAUTHENTICATED
    conn.close()


def test_token_refresh_through_token_source(server, make_token, client_ctx, spec):
    class Source:
        def __init__(self):
            self.calls = 0
            self.token = make_token(exp=int(time.time()) - 60)  # the first one is already expired

        def get(self):
            self.calls += 1
            return self

        def invalidate(self):
            self.token = make_token()

    src = Source()
    with client_for(server, src, client_ctx) as dp:
        assert dp.lookup(TOKENS) == 0
    assert src.calls == 2


# ---- refusals ------------------------------------------------------------------------------------------------------
def test_identity_mismatch_refused_before_any_byte(server, make_token, client_ctx, raw, registry):
    other = tiny_spec(num_kv_heads=1)
    with pytest.raises(Exception) as info:  # the SDK checks HELLO's identity locally
        client_for(server, make_token(), client_ctx, spec=other).lookup(TOKENS)
    assert getattr(info.value, "code", None) == "identity_mismatch"
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK
    kv = prefix_kv(other, TOKENS)
    reply = conn.request(Opcode.PUT, TOKENS, identity=other, kv=memoryview(kv.numpy()).cast("B"))
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.IDENTITY_MISMATCH
    assert "num_kv_heads" in reply.meta["details"]["fields"]
    reply = conn.request(Opcode.GET, TOKENS, identity=tiny_spec(model_fingerprint="other-model@1"))
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.IDENTITY_MISMATCH
    assert conn.request(Opcode.LOOKUP, TOKENS).opcode == Opcode.OK  # a request error keeps the connection
    assert lookup_a(registry) == 0


BAD_TOKENS = {
    "expired": (dict(exp=lambda: int(time.time()) - 60), ErrorCode.TOKEN_EXPIRED),
    "not_yet_valid": (dict(nbf=lambda: int(time.time()) + 600), ErrorCode.UNAUTHENTICATED),
    "wrong_issuer": (dict(iss="evil"), ErrorCode.UNAUTHENTICATED),
    "no_jti": (dict(jti=None), ErrorCode.UNAUTHENTICATED),
    "wrong_audience": (dict(aud=f"cache:{CACHE_B}"), ErrorCode.NOT_FOUND),
    "wrong_node": (dict(node="node-2"), ErrorCode.NOT_FOUND),
    "old_epoch": (dict(epoch=EPOCH - 1), ErrorCode.NOT_FOUND),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_bad_tokens_refused_and_no_data(case, server, make_token, raw, registry, spec):
    registry.get(CACHE_A).engine.put(TOKENS, prefix_kv(spec, TOKENS))
    overrides, code = BAD_TOKENS[case]
    overrides = {k: (v() if callable(v) else v) for k, v in overrides.items()}
    conn = raw()
    reply = conn.hello(make_token(**overrides))
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == code
    reply = conn.request(Opcode.GET, TOKENS)
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.UNAUTHENTICATED
    assert reply.payload_len == 0


def test_tampered_foreign_key_and_hs256_tokens_refused(server, make_token, raw, jwks):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    good = make_token()
    head, body, sig = good.split(".")
    forged_body = make_token(aud=f"cache:{CACHE_A}", sub="tenant:t-b").split(".")[1]
    tampered = [
        f"{head}.{forged_body}.{sig}",  # claims changed after signing
        f"{head}.{body}.{sig[:-4]}AAAA",  # signature changed
        make_token(key=Ed25519PrivateKey.generate()),  # signed by someone else's key (with our kid)
        make_token(key=b"x" * 32, algorithm="HS256"),  # alg confusion: HMAC
        make_token(key=jwks["keys"][0]["x"].encode(), algorithm="HS256"),  # HMAC keyed with the public key
        "not-a-jwt",
    ]
    conn = raw()
    for token in tampered:
        reply = conn.hello(token)
        assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.UNAUTHENTICATED, token
    reply = conn.request(Opcode.LOOKUP, TOKENS)
    assert reply.meta["code"] == ErrorCode.UNAUTHENTICATED


def test_revoked_jti_cuts_the_open_connection_and_is_refused_after(server, make_token, raw, verifier):
    token = make_token(jti="jti-to-revoke")
    conn, other = raw(), raw()
    assert conn.hello(token).opcode == Opcode.OK and other.hello(make_token()).opcode == Opcode.OK
    assert conn.request(Opcode.LOOKUP, TOKENS).opcode == Opcode.OK
    verifier.revocations.update([{"jti": "jti-to-revoke", "exp": time.time() + 60}])  # as a push or heartbeat
    assert conn.closed()  # cut at once, not at its next request
    assert other.request(Opcode.LOOKUP, TOKENS).opcode == Opcode.OK  # a session of another token is untouched
    reply = raw().hello(token)
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.UNAUTHENTICATED


def test_read_token_cannot_write(server, make_token, raw, spec, registry):
    conn = raw()
    assert conn.hello(make_token(access="read")).opcode == Opcode.OK
    kv = prefix_kv(spec, TOKENS)
    reply = conn.request(Opcode.PUT, TOKENS, kv=memoryview(kv.numpy()).cast("B"))
    assert reply.meta["code"] == ErrorCode.FORBIDDEN
    assert conn.request(Opcode.DELETE, TOKENS).meta["code"] == ErrorCode.FORBIDDEN
    assert conn.request(Opcode.LOOKUP, TOKENS).opcode == Opcode.OK
    assert lookup_a(registry) == 0


def test_other_tenant_cannot_read_and_learns_nothing(server, make_token, raw, registry, spec, client_ctx):
    registry.get(CACHE_A).engine.put(TOKENS, prefix_kv(spec, TOKENS))
    token_b = make_token(CACHE_B, sub="tenant:t-b")
    conn = raw()
    on_existing = conn.hello(token_b, cache_id=CACHE_A)  # B's token, A's (existing) cache
    on_missing = conn.hello(token_b, cache_id="c_doesnotexist")  # B's token, no such cache
    assert on_existing.opcode == on_missing.opcode == Opcode.ERROR
    assert on_existing.meta == on_missing.meta  # identical answers: existence is not revealed
    assert on_existing.meta["code"] == ErrorCode.NOT_FOUND
    # a session for B does not open A: requests naming A are refused, with no KV
    assert conn.hello(token_b, cache_id=CACHE_B).opcode == Opcode.OK
    reply = conn.request(Opcode.GET, TOKENS, cache_id=CACHE_A)
    assert reply.opcode == Opcode.ERROR and reply.payload_len == 0
    # B's identical prompt in its own cache is a miss (keyed hashes, separate pools)
    with client_for(server, token_b, client_ctx, cache_id=CACHE_B) as dp_b:
        assert dp_b.lookup(TOKENS) == 0
        n, _ = dp_b.get(TOKENS)
        assert n == 0
    # and through the SDK the error is the same too
    with pytest.raises(DataPlaneError) as a_err:
        client_for(server, token_b, client_ctx, cache_id=CACHE_A).lookup(TOKENS)
    with pytest.raises(DataPlaneError) as missing_err:
        client_for(server, token_b, client_ctx, cache_id="c_doesnotexist").lookup(TOKENS)
    assert (a_err.value.code, a_err.value.message) == (missing_err.value.code, missing_err.value.message)


# ---- bad input -----------------------------------------------------------------------------------------------------
def _put_frame(spec, rid=7):
    kv = prefix_kv(spec, TOKENS)
    return b"".join(
        bytes(b)
        for b in wire.encode_request(
            Opcode.PUT, rid, cache_id=CACHE_A, identity=spec, token_ids=[TOKENS], kv=[kv.numpy()]
        )
    )


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64, b"KCW\x00\x09" + b"\x00" * 40])
def test_garbage_gets_error_and_close(server, make_token, raw, garbage, registry):
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK
    conn.sock.sendall(garbage)
    reply = conn.read()
    assert reply is None or reply.opcode == Opcode.ERROR
    assert conn.closed()
    assert lookup_a(registry) == 0


def test_truncated_put_leaves_cache_unchanged(server, make_token, raw, spec, registry):
    frame = _put_frame(spec)
    for cut in (10, 40, len(frame) // 2, len(frame) - 1):
        conn = raw()
        assert conn.hello(make_token()).opcode == Opcode.OK
        conn.sock.sendall(frame[:cut])
        conn.sock.close()  # the stream ends inside the frame
    # every cut connection is done with (its thread has left, its holds released): whatever it would store is stored
    assert eventually(lambda: server.connection_count() == 0), "the server still serves a cut connection"
    assert lookup_a(registry) == 0
    assert registry.get(CACHE_A).engine.stats().num_used_blocks == 0


def test_slow_loris_is_cut_and_nothing_is_written(server, make_token, raw, spec, registry):
    frame = _put_frame(spec)
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK
    conn.sock.sendall(frame[:-5])  # the server's frame_timeout is 1 s in these tests
    assert conn.closed(timeout=4.0)
    assert lookup_a(registry) == 0


def test_oversized_declared_payload_refused_without_allocation(server, make_token, raw, registry):
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK
    meta = b'{"cache_id":"%s"}' % CACHE_A.encode()
    header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, Opcode.PUT, 0, 9, len(meta), 0, 1 << 40)
    conn.sock.sendall(header + meta)
    reply = conn.read()
    assert reply is not None and reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.FRAME_TOO_LARGE
    assert reply.request_id == 9
    assert conn.closed()
    # a PUT whose payload_len disagrees with its metadata: refused, payload discarded, stream stays usable
    frame = bytearray(_put_frame(tiny_spec(), rid=11))
    meta_len = struct.unpack_from("<I", frame, 16)[0]
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK
    struct.pack_into("<Q", frame, 24, struct.unpack_from("<Q", frame, 24)[0] - 4)
    conn.sock.sendall(bytes(frame[: 32 + meta_len + struct.unpack_from("<Q", frame, 24)[0]]))
    reply = conn.read()
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.PAYLOAD_LENGTH_MISMATCH
    assert conn.request(Opcode.LOOKUP, TOKENS).meta == {"op": "lookup", "num_cached": [0]}
    assert lookup_a(registry) == 0


def test_request_before_hello_and_response_opcodes_refused(server, raw, registry):
    conn = raw()
    reply = conn.request(Opcode.LOOKUP, TOKENS)
    assert reply.meta["code"] == ErrorCode.UNAUTHENTICATED
    conn.send(wire.encode_error(5, "internal", "x"))
    assert conn.read().meta["code"] == ErrorCode.BAD_REQUEST


def test_tls12_only_client_refused(server, pki):
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(server.address, timeout=5) as s:
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            ctx.wrap_socket(s, server_hostname="127.0.0.1")


def test_stop_closes_connections_and_listeners(registry, verifier, pki, client_ctx, make_token, tmp_path):
    from gpu_node.dataplane.server import DataPlaneServer, server_tls_context

    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        uds_path=str(tmp_path / "s.sock"),
    ).start()
    dp = client_for(srv, make_token(), client_ctx)
    assert dp.lookup(TOKENS) == 0
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 3
    assert srv.connection_count() == 0
    with pytest.raises(DataPlaneError):
        dp.lookup(TOKENS)
    with pytest.raises(OSError):
        socket.create_connection(srv.address, timeout=1)


# ---- batch forms and a fuzzed stream ---------------------------------------------------------------------------------
def test_batch_forms(server, make_token, raw, spec, registry):
    seqs = [np.arange(10, 19, dtype=np.int32), np.arange(300, 306, dtype=np.int32)]
    kvs = [prefix_kv(spec, s) for s in seqs]
    conn = raw()
    assert conn.hello(make_token()).opcode == Opcode.OK

    def call(opcode, **kw):
        conn.rid += 1
        conn.send(wire.encode_request(opcode, conn.rid, cache_id=CACHE_A, identity=spec, token_ids=seqs, **kw))
        return wire.parse_response(conn.read(), request_opcode=opcode, num_sequences=2, spec=spec)

    assert call(Opcode.PUT_BATCH, kv=[k.numpy() for k in kvs]).num_cached == (9, 6)
    assert call(Opcode.LOOKUP_BATCH).num_cached == (9, 6)
    got = call(Opcode.GET_BATCH)
    for view, kv in zip(got.kv, kvs):
        assert torch.equal(torch.frombuffer(bytearray(view), dtype=torch.float32).view(kv.shape), kv)
    assert all(n >= 1 for n in call(Opcode.DELETE_BATCH).num_removed_blocks)
    assert call(Opcode.LOOKUP_BATCH).num_cached == (0, 0)


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_stream_after_hello_never_writes(server, make_token, spec, registry, data):
    """Mutations of a valid PUT stream, sent over the Unix socket after a valid HELLO: the node answers frames (OK
    only for a PUT that arrived intact), ERROR, or closes; it never stores KV for a damaged frame."""
    frame = bytearray(_put_frame(spec))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(frame)))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.uds_path)
    conn = RawConn(s)
    try:
        assert conn.hello(make_token()).opcode == Opcode.OK
        s.sendall(bytes(frame[:cut]))
        s.shutdown(socket.SHUT_WR)
        replies = []
        while (reply := conn.read()) is not None:
            replies.append(reply)
        stored = lookup_a(registry)
        if stored:  # only an intact PUT of these exact tokens (the mutation hit bytes the node ignores)
            assert any(r.opcode == Opcode.OK for r in replies)
            n, kv = registry.get(CACHE_A).engine.get(TOKENS)
            assert n == stored
    finally:
        conn.close()
        registry.get(CACHE_A).engine.clear()


def test_unknown_kid_refetches_jwks_once(jwks, signing_key, make_token):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gpu_node.dataplane.server import TokenVerifier
    from tests.gpu_node.dataplane.conftest import ISSUER, public_jwk

    new_key = Ed25519PrivateKey.generate()
    new_jwk = public_jwk(new_key)
    calls = []

    def fetch():
        calls.append(1)
        return {"keys": [jwks["keys"][0], new_jwk]}

    verifier = TokenVerifier(jwks, issuer=ISSUER, fetch_jwks=fetch)
    rotated = make_token(key=new_key, headers={"kid": new_jwk["kid"], "typ": "JWT"})
    assert verifier.verify(rotated)["aud"] == f"cache:{CACHE_A}"
    with pytest.raises(wire.ProtocolError):
        verifier.verify(make_token(headers={"kid": "forged", "typ": "JWT"}))
    assert len(calls) == 1  # the forged kid did not trigger a second fetch within the interval


def test_sdk_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, kcaas, kcaas.dataplane; kcaas.DataPlaneClient; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
