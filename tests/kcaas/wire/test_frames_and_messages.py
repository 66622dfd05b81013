"""The data-plane wire format (kcaas/wire/__init__.py): layout, round trips, every error path, incremental decoding."""

import json
import struct
import subprocess
import sys
import tracemalloc
from array import array

import pytest

from kcaas import wire
from kcaas.spec import IdentityMismatch, KVCacheSpec
from kcaas.wire import ErrorCode, Opcode, ProtocolError

SPEC = KVCacheSpec("tiny-llama@abc123", 2, 1, 2, 4, "float16", "float16")  # 16 bytes of KV per token


def join(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def kv_bytes(num_tokens: int, seed: int = 0) -> bytes:
    return bytes((seed + i) % 251 for i in range(wire.kv_nbytes(SPEC, num_tokens)))


def raw_frame(
    opcode=Opcode.HELLO,
    meta=b"{}",
    payload=b"",
    *,
    magic=wire.MAGIC,
    version=1,
    flags=0,
    request_id=9,
    reserved=0,
    meta_len=None,
    payload_len=None,
) -> bytes:
    meta_len = len(meta) if meta_len is None else meta_len
    payload_len = len(payload) if payload_len is None else payload_len
    return wire.HEADER.pack(magic, version, opcode, flags, request_id, meta_len, reserved, payload_len) + meta + payload


def expect(code: str, data: bytes, **limits) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        wire.decode_frame(data, **limits)
    assert info.value.code == code, info.value
    return info.value


# ---- layout ---------------------------------------------------------------------------------------------------------
def test_header_layout_is_32_bytes_little_endian():
    frame = join(wire.encode_frame(Opcode.LOOKUP, 0x0102030405060708, {"a": 1}, [b"\x01\x00\x00\x00"]))
    assert wire.HEADER_SIZE == 32
    assert frame[:4] == b"KCW\x00"
    assert frame[4] == 1 and frame[5] == 0x02 and frame[6:8] == b"\x00\x00"
    assert frame[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert struct.unpack("<I", frame[16:20])[0] == len(b'{"a":1}')
    assert frame[20:24] == b"\x00" * 4
    assert struct.unpack("<Q", frame[24:32])[0] == 4
    assert frame[32:39] == b'{"a":1}' and frame[39:] == b"\x01\x00\x00\x00"


def test_encode_frame_does_not_join_the_payload():
    kv = bytearray(kv_bytes(3))
    buffers = wire.encode_request(Opcode.PUT, 1, cache_id="c", identity=SPEC, token_ids=[[1, 2, 3]], kv=[kv])
    assert len(buffers) == 3  # header+metadata, tokens, KV
    assert buffers[2].obj is kv  # the caller's KV buffer itself goes to sendmsg: no copy


def test_put_batch_payload_is_all_token_arrays_then_all_kv_in_order():
    kv0, kv1 = kv_bytes(3, 1), kv_bytes(2, 2)
    frame = join(
        wire.encode_request(
            Opcode.PUT_BATCH, 5, cache_id="c", identity=SPEC, token_ids=[[1, 2, -3], [2**31 - 1, 0]], kv=[kv0, kv1]
        )
    )
    meta_len = struct.unpack("<I", frame[16:20])[0]
    meta = json.loads(frame[32 : 32 + meta_len])
    assert meta == {"cache_id": "c", "identity": SPEC.to_dict(), "num_tokens": [3, 2]}
    tokens = struct.pack("<5i", 1, 2, -3, 2**31 - 1, 0)
    assert frame[32 + meta_len :] == tokens + kv0 + kv1


# ---- round trips ----------------------------------------------------------------------------------------------------
def test_hello_round_trip():
    frame = wire.decode_frame(join(wire.encode_hello(1, cache_id="cache-1", token="jwt.x.y", client="t/1")))
    assert frame.opcode == Opcode.HELLO and frame.payload == ()
    assert wire.parse_hello(frame) == wire.Hello(1, "cache-1", "jwt.x.y", "t/1")


def test_hello_carries_the_identity_and_the_answers_the_client_takes():
    frame = wire.decode_frame(
        join(wire.encode_hello(1, cache_id="c", token="t", identity=SPEC, max_answer_bytes=1 << 40))
    )
    assert wire.parse_hello(frame) == wire.Hello(1, "c", "t", "kcaas-py/0.1", SPEC, 1 << 40)
    ok = wire.decode_frame(
        join(wire.encode_hello_ok(1, cache_id="c", identity=SPEC, epoch=2, node_id="n", max_answer_bytes=1 << 30))
    )
    assert wire.parse_response(ok, request_opcode=Opcode.HELLO).max_answer_bytes == 1 << 30
    old_ok = wire.decode_frame(join(wire.encode_hello_ok(1, cache_id="c", identity=SPEC, epoch=2, node_id="n")))
    assert "max_answer_bytes" not in old_ok.meta  # an older client refuses unknown fields: sent only when offered
    for bad in ({"max_answer_bytes": "1"}, {"max_answer_bytes": 8}, {"identity": {"num_layers": 2}}):
        meta = {"cache_id": "c", "token": "t", **bad}
        with pytest.raises(ProtocolError):
            wire.parse_hello(wire.decode_frame(join(wire.encode_frame(Opcode.HELLO, 1, meta))))


def test_a_request_may_leave_the_identity_to_its_session():
    frame = wire.decode_frame(
        join(
            wire.encode_request(
                Opcode.PUT,
                1,
                cache_id="c",
                identity=None,
                session_identity=SPEC,
                token_ids=[[1, 2]],
                kv=[kv_bytes(2, 1)],
            )
        )
    )
    assert "identity" not in frame.meta
    head = wire.parse_request_head(frame, SPEC)
    assert head.identity == SPEC and not head.identity_sent and head.op == "put"
    with pytest.raises(ProtocolError) as missing:
        wire.parse_request_head(frame)  # no session identity either
    assert missing.value.code == ErrorCode.BAD_REQUEST and "identity" in missing.value.message
    with pytest.raises(ValueError):
        wire.encode_request(Opcode.LOOKUP, 1, cache_id="c", identity=None, token_ids=[[1]])


def test_a_remembered_identity_is_the_same_validated_spec_and_types_are_not_conflated():
    first = wire.spec_from_wire(SPEC.to_dict())
    assert wire.spec_from_wire(SPEC.to_dict()) is first and first == SPEC
    with pytest.raises(ProtocolError):
        wire.spec_from_wire({**SPEC.to_dict(), "num_layers": "2"})  # a string where an int is due: still refused
    with pytest.raises(ProtocolError):
        wire.spec_from_wire({**SPEC.to_dict(), "num_layers": True})


@pytest.mark.parametrize("opcode", sorted(wire.DATA_OPS))
def test_data_request_round_trip(opcode):
    batch = bool(opcode & wire.BATCH_BIT)
    seqs = [[5, 6, 7, 8, 9], [1], [2**31 - 1, -(2**31)]] if batch else [[5, 6, 7, 8, 9]]
    is_put = (opcode & ~wire.BATCH_BIT) == Opcode.PUT
    kv = [kv_bytes(len(s), i) for i, s in enumerate(seqs)] if is_put else None
    data = join(wire.encode_request(opcode, 77, cache_id="c9", identity=SPEC, token_ids=seqs, kv=kv))
    request = wire.parse_request(wire.decode_frame(data))
    assert request.opcode == opcode and request.request_id == 77 and request.is_batch == batch
    assert request.cache_id == "c9" and request.identity == SPEC
    assert [list(t) for t in request.token_ids] == seqs
    assert request.num_tokens == tuple(len(s) for s in seqs) and request.kv_start == (0,) * len(seqs)
    assert [bytes(k) for k in request.kv] == (kv or [])


def test_kv_start_round_trip_for_put_and_get():
    data = join(
        wire.encode_request(
            Opcode.PUT, 1, cache_id="c", identity=SPEC, token_ids=[[1, 2, 3, 4]], kv=[kv_bytes(1)], kv_start=[3]
        )
    )
    request = wire.parse_request(wire.decode_frame(data))
    assert request.kv_start == (3,) and request.kv_bytes == (16,) and bytes(request.kv[0]) == kv_bytes(1)
    data = join(wire.encode_request(Opcode.GET, 2, cache_id="c", identity=SPEC, token_ids=[[1, 2]], kv_start=[2]))
    assert wire.parse_request(wire.decode_frame(data)).kv_start == (2,)
    with pytest.raises(ValueError):
        wire.encode_request(Opcode.LOOKUP, 1, cache_id="c", identity=SPEC, token_ids=[[1]], kv_start=[0])


def test_token_ids_from_buffers():
    assert wire.pack_token_ids(array("i", [1, -2])).tobytes() == struct.pack("<2i", 1, -2)
    view = memoryview(array("i", [3, 4]))
    assert wire.pack_token_ids(view).obj is view.obj  # a native int32 buffer is sent as is
    assert wire.pack_token_ids(array("q", [7, 8])).tobytes() == struct.pack("<2i", 7, 8)
    assert list(wire.unpack_token_ids(struct.pack("<3i", 1, 2, 3))) == [1, 2, 3]


def response(frames, **kwargs):
    return wire.parse_response(wire.decode_frame(join(frames)), **kwargs)


def test_responses_round_trip():
    hello = response(
        wire.encode_hello_ok(1, cache_id="c", identity=SPEC, epoch=3, node_id="n1"), request_opcode=Opcode.HELLO
    )
    assert hello == wire.HelloOk("c", SPEC, 3, "n1", wire.DEFAULT_MAX_FRAME_BYTES, wire.DEFAULT_MAX_METADATA_BYTES)
    assert response(wire.encode_lookup_ok(2, [4, 0]), request_opcode=Opcode.LOOKUP_BATCH, num_sequences=2) == (
        wire.LookupOk((4, 0))
    )
    put = response(
        wire.encode_put_ok(3, num_cached=[5], num_written=[1], out_of_space=[False]), request_opcode=Opcode.PUT
    )
    assert put == wire.PutOk((5,), (1,), (False,))
    assert response(wire.encode_delete_ok(4, [2]), request_opcode=Opcode.DELETE) == wire.DeleteOk((2,))
    kv0, kv1 = kv_bytes(3, 1), kv_bytes(0)
    get = response(
        wire.encode_get_ok(5, spec=SPEC, num_cached=[3, 0], kv_start=[0, 0], kv_end=[3, 0], kv=[kv0, kv1]),
        request_opcode=Opcode.GET_BATCH,
        num_sequences=2,
        spec=SPEC,
    )
    assert (get.num_cached, get.kv_start, get.kv_end) == ((3, 0), (0, 0), (3, 0))
    assert [bytes(k) for k in get.kv] == [kv0, b""]
    error = response(wire.encode_error(6, "overloaded", "slow down", {"retry_after_ms": 50}), request_opcode=Opcode.PUT)
    assert error == wire.ErrorReply("overloaded", "slow down", {"retry_after_ms": 50})
    moved = response(wire.encode_moved(7, cache_id="c", endpoint="10.0.0.2:7443", epoch=4), request_opcode=Opcode.GET)
    assert moved == wire.Moved("c", "10.0.0.2:7443", 4)


def test_response_for_another_op_or_count_is_refused():
    with pytest.raises(ProtocolError) as info:
        response(wire.encode_lookup_ok(2, [4]), request_opcode=Opcode.PUT)
    assert info.value.code == ErrorCode.BAD_METADATA
    with pytest.raises(ProtocolError) as info:
        response(wire.encode_lookup_ok(2, [4]), request_opcode=Opcode.LOOKUP_BATCH, num_sequences=2)
    assert info.value.code == ErrorCode.BAD_REQUEST
    frame = wire.decode_frame(
        raw_frame(Opcode.OK, b'{"op":"get","num_cached":[2],"kv_start":[0],"kv_end":[2]}', b"x" * 31)
    )
    with pytest.raises(ProtocolError) as info:
        wire.parse_response(frame, request_opcode=Opcode.GET, spec=SPEC)
    assert info.value.code == ErrorCode.PAYLOAD_LENGTH_MISMATCH


def test_get_kv_end_keeps_the_response_within_the_frame():
    limit = 1 << 20
    big = KVCacheSpec("m", 4, 2, 64, 16, "float32", "float32")  # 4 KiB per token
    ends = wire.get_kv_end(big, [500, 300, 10], [0, 0, 20], max_frame_bytes=limit)
    assert ends[2] == 10  # kv_start beyond the cached prefix: nothing to send
    assert ends[0] + ends[1] <= limit // big.kv_bytes_per_token and ends[0] <= 500 and ends[1] <= ends[0]
    kv = [bytes(wire.kv_nbytes(big, e - s)) for s, e in zip([0, 0], ends[:2])]
    frames = wire.encode_get_ok(
        1, spec=big, num_cached=[500, 300], kv_start=[0, 0], kv_end=ends[:2], kv=kv, max_frame_bytes=limit
    )
    assert sum(memoryview(b).nbytes for b in frames) <= limit


# ---- errors: the stream ---------------------------------------------------------------------------------------------
def test_bad_magic_version_opcode_flags_reserved():
    expect(ErrorCode.BAD_MAGIC, raw_frame(magic=b"HTTP"))
    assert expect(ErrorCode.UNSUPPORTED_VERSION, raw_frame(version=2)).request_id is None
    assert expect(ErrorCode.UNKNOWN_OPCODE, raw_frame(opcode=0x7F, request_id=42)).request_id == 42
    expect(ErrorCode.BAD_HEADER, raw_frame(flags=1))
    expect(ErrorCode.BAD_HEADER, raw_frame(reserved=1))


def test_oversized_metadata_and_frame_are_refused_from_the_header_alone():
    decoder = wire.FrameDecoder(max_frame_bytes=1 << 20, max_metadata_bytes=1024)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decoder.feed(raw_frame(meta_len=2**32 - 1)[:32])
        assert info.value.code == ErrorCode.METADATA_TOO_LARGE
        with pytest.raises(ProtocolError) as info:
            wire.FrameDecoder(max_frame_bytes=1 << 20).feed(raw_frame(Opcode.PUT, payload_len=2**64 - 1)[:32])
        assert info.value.code == ErrorCode.FRAME_TOO_LARGE
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024
    expect(ErrorCode.METADATA_TOO_LARGE, raw_frame(meta=b'{"a":"' + b"x" * 70000 + b'"}'))
    expect(ErrorCode.FRAME_TOO_LARGE, raw_frame(Opcode.PUT, payload=b"x" * 100), max_frame_bytes=100)
    with pytest.raises(ProtocolError) as info:
        wire.encode_frame(Opcode.PUT, 1, {}, [b"x" * 100], max_frame_bytes=100)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize(
    "meta", [b"", b"{", b"\xff\xfe{}", b"[1, 2]", b'"s"', b"null", b'{"a": NaN}', b'{"a": 1, "a": 2}', b"{} x"]
)
def test_malformed_or_non_object_metadata(meta):
    expect(ErrorCode.BAD_METADATA, raw_frame(meta=meta))


def test_payload_on_a_frame_without_one():
    expect(ErrorCode.PAYLOAD_LENGTH_MISMATCH, raw_frame(Opcode.HELLO, payload=b"xx"))
    expect(ErrorCode.PAYLOAD_LENGTH_MISMATCH, raw_frame(Opcode.ERROR, payload=b"xx"))


def test_truncated_and_trailing():
    good = join(wire.encode_lookup_ok(1, [3]))
    for cut in (0, 5, 32, len(good) - 1):
        expect(ErrorCode.TRUNCATED_FRAME, good[:cut])
    expect(ErrorCode.TRAILING_BYTES, good + b"\x00")
    decoder = wire.FrameDecoder()
    decoder.feed(good[:-1])
    with pytest.raises(ProtocolError) as info:
        decoder.eof()
    assert info.value.code == ErrorCode.TRUNCATED_FRAME and info.value.request_id == 1
    wire.FrameDecoder().eof()  # EOF between frames is a clean close


def test_garbage_after_a_frame_in_a_stream_fails_the_decoder_for_good():
    decoder = wire.FrameDecoder()
    with pytest.raises(ProtocolError) as info:
        decoder.feed(join(wire.encode_lookup_ok(1, [3])) + b"GET / HTTP/1.1\r\nHost: kcaas.example\r\n\r\n")
    assert info.value.code == ErrorCode.BAD_MAGIC
    assert decoder.next_frame() is not None  # the good frame before the garbage was delivered
    with pytest.raises(ProtocolError):
        decoder.feed(join(wire.encode_lookup_ok(2, [3])))


# ---- errors: one request --------------------------------------------------------------------------------------------
def data_frame(opcode, meta: dict, payload: bytes = b"") -> wire.Frame:
    return wire.decode_frame(raw_frame(opcode, json.dumps(meta).encode(), payload))


def bad_request_code(opcode, meta, payload=b"") -> str:
    with pytest.raises(ProtocolError) as info:
        wire.parse_request(data_frame(opcode, meta, payload))
    assert info.value.request_id == 9
    return info.value.code


def test_request_errors_have_exact_codes():
    ok = {"cache_id": "c", "identity": SPEC.to_dict(), "num_tokens": [2]}
    tokens = struct.pack("<2i", 1, 2)
    assert wire.parse_request(data_frame(Opcode.LOOKUP, ok, tokens)).num_tokens == (2,)
    assert bad_request_code(Opcode.LOOKUP, {**ok, "cache_id": ""}, tokens) == ErrorCode.BAD_REQUEST
    assert bad_request_code(Opcode.LOOKUP, {**ok, "extra": 1}, tokens) == ErrorCode.BAD_REQUEST
    assert bad_request_code(Opcode.LOOKUP, {**ok, "kv_start": [0]}, tokens) == ErrorCode.BAD_REQUEST
    assert bad_request_code(Opcode.LOOKUP, {**ok, "num_tokens": [1, 1]}, tokens) == ErrorCode.BAD_REQUEST  # not batch
    assert bad_request_code(Opcode.LOOKUP_BATCH, {**ok, "num_tokens": []}) == ErrorCode.BAD_REQUEST
    assert bad_request_code(Opcode.LOOKUP, {**ok, "num_tokens": 2}, tokens) == ErrorCode.BAD_REQUEST
    assert bad_request_code(Opcode.LOOKUP, {**ok, "num_tokens": [0]}) == ErrorCode.BAD_TOKENS
    assert bad_request_code(Opcode.LOOKUP, {**ok, "num_tokens": [True]}, b"\0" * 4) == ErrorCode.BAD_TOKENS
    assert bad_request_code(Opcode.LOOKUP, {**ok, "num_tokens": [2**40]}) == ErrorCode.BAD_TOKENS
    assert bad_request_code(Opcode.LOOKUP, {**ok, "identity": [1]}, tokens) == ErrorCode.BAD_REQUEST
    assert (
        bad_request_code(Opcode.LOOKUP, {**ok, "identity": {**SPEC.to_dict(), "head_dim": 0}}, tokens)
        == ErrorCode.INVALID_SPEC
    )
    assert bad_request_code(Opcode.LOOKUP, {**ok, "identity": {"x": 1}}, tokens) == ErrorCode.INVALID_SPEC
    assert bad_request_code(Opcode.LOOKUP, ok, tokens + b"\0") == ErrorCode.PAYLOAD_LENGTH_MISMATCH
    assert bad_request_code(Opcode.PUT, ok, tokens + kv_bytes(2)[:-1]) == ErrorCode.PAYLOAD_LENGTH_MISMATCH
    assert bad_request_code(Opcode.PUT, {**ok, "kv_start": [3]}, tokens) == ErrorCode.BAD_REQUEST
    assert bad_request_code(Opcode.GET, {**ok, "kv_start": [-1]}, tokens) == ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError) as info:
        wire.parse_hello(data_frame(Opcode.HELLO, {"cache_id": "c"}))
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_token_validation_on_the_encoding_side():
    for bad in ([2**31], [-(2**31) - 1], [1.5], ["1"], [None]):
        with pytest.raises(ProtocolError) as info:
            wire.pack_token_ids(bad)
        assert info.value.code == ErrorCode.BAD_TOKENS
    with pytest.raises(ProtocolError) as info:
        wire.encode_request(Opcode.LOOKUP, 1, cache_id="c", identity=SPEC, token_ids=[[]])
    assert info.value.code == ErrorCode.BAD_TOKENS
    with pytest.raises(ValueError):  # KV of the wrong size never leaves the client
        wire.encode_request(Opcode.PUT, 1, cache_id="c", identity=SPEC, token_ids=[[1]], kv=[b"x"])


def test_error_frames_never_carry_exception_text():
    secret = RuntimeError("Traceback ... /srv/node/keys/cache-7.key")
    assert json.loads(join(wire.encode_error_for(secret, 3))[32:]) == {"code": "internal", "message": "internal error"}
    mismatch = IdentityMismatch({"num_kv_heads": (2, 4)})
    meta = json.loads(join(wire.encode_error_for(mismatch, 3))[32:])
    assert meta["code"] == "identity_mismatch" and meta["details"] == {"fields": {"num_kv_heads": [2, 4]}}
    meta = json.loads(join(wire.encode_error_for(ProtocolError("bad_tokens", "no"), 3))[32:])
    assert meta == {"code": "bad_tokens", "message": "no"}
    assert len(json.loads(join(wire.encode_error(1, "x", "m" * 10_000))[32:])["message"]) == 1024


# ---- incremental decoding -------------------------------------------------------------------------------------------
STREAM_FRAMES = [
    wire.encode_hello(1, cache_id="c", token="t"),
    wire.encode_request(
        Opcode.PUT_BATCH, 2, cache_id="c", identity=SPEC, token_ids=[[1, 2, 3], [4]], kv=[kv_bytes(3), kv_bytes(1, 9)]
    ),
    wire.encode_get_ok(3, spec=SPEC, num_cached=[2], kv_start=[0], kv_end=[2], kv=[kv_bytes(2, 5)]),
    wire.encode_error(4, "forbidden", "read-only token"),
    wire.encode_request(Opcode.LOOKUP, 5, cache_id="c", identity=SPEC, token_ids=[[7] * 9]),
]
STREAM = b"".join(join(f) for f in STREAM_FRAMES)


def summary(frame: wire.Frame):
    return frame.opcode, frame.request_id, frame.meta, b"".join(bytes(p) for p in frame.payload)


EXPECTED = [summary(wire.decode_frame(join(f))) for f in STREAM_FRAMES]


def test_a_stream_split_at_every_byte_boundary_gives_the_same_frames():
    for cut in range(len(STREAM) + 1):
        decoder = wire.FrameDecoder()
        decoder.feed(STREAM[:cut])
        got = [summary(f) for f in decoder.frames()]
        decoder.feed(STREAM[cut:])
        got += [summary(f) for f in decoder.frames()]
        decoder.eof()
        assert got == EXPECTED, cut


def test_byte_by_byte_and_recv_into():
    decoder = wire.FrameDecoder()
    for i in range(len(STREAM)):
        decoder.feed(STREAM[i : i + 1])
    assert [summary(f) for f in decoder.frames()] == EXPECTED
    for chunk in (1, 7, 33, 4096):  # the recv_into shape: get_buffer, copy in at most `chunk` bytes, buffer_updated
        decoder, pos = wire.FrameDecoder(), 0
        while pos < len(STREAM):
            buf = decoder.get_buffer()
            n = min(chunk, buf.nbytes, len(STREAM) - pos)
            buf[:n] = STREAM[pos : pos + n]
            decoder.buffer_updated(n)
            pos += n
        assert [summary(f) for f in decoder.frames()] == EXPECTED


def test_payload_sink_receives_the_payload_in_place():
    big = KVCacheSpec("m", 4, 2, 64, 16, "float16", "float16")  # 2 KiB per token
    tokens, kv = list(range(100)), bytes(range(256)) * (wire.kv_nbytes(big, 100) // 256)
    data = join(wire.encode_request(Opcode.PUT, 8, cache_id="c", identity=big, token_ids=[tokens], kv=[kv]))
    token_buf, staging = bytearray(400), bytearray(len(kv))  # staging: e.g. a pinned tensor's memory

    def sink(head):
        request = wire.parse_request_head(head)
        return [token_buf, memoryview(staging)[: sum(request.kv_bytes)]]

    decoder, pos, direct = wire.FrameDecoder(payload_sink=sink), 0, 0
    while pos < len(data):
        buf = decoder.get_buffer()
        direct += buf.obj is staging
        n = min(buf.nbytes, len(data) - pos, 65536)
        buf[:n] = data[pos : pos + n]
        decoder.buffer_updated(n)
        pos += n
    frame = decoder.next_frame()
    assert direct > 0  # most of the KV went from the "socket" straight into staging
    assert decoder.buffered_payload_bytes == 0 and bytes(staging) == kv
    request = wire.parse_request(frame)
    assert list(request.token_ids[0]) == tokens and request.kv[0].obj is staging


def test_a_refused_request_is_discarded_and_the_stream_stays_in_sync():
    def sink(head):
        if head.request_id == 2:
            raise ProtocolError(ErrorCode.FORBIDDEN, "read-only token")
        return None

    decoder = wire.FrameDecoder(payload_sink=sink)
    decoder.feed(STREAM)
    frames = list(decoder.frames())
    assert [f.request_id for f in frames] == [1, 2, 3, 4, 5]
    assert frames[1].discarded and frames[1].payload == () and frames[1].error.code == ErrorCode.FORBIDDEN
    assert frames[1].error.request_id == 2
    assert summary(frames[4]) == EXPECTED[4]


def test_memory_follows_received_bytes_not_declared_lengths():
    decoder = wire.FrameDecoder()
    header = raw_frame(Opcode.PUT, b"{}", payload_len=200 << 20)[: 32 + 2]
    decoder.feed(header + b"x" * 10)  # a slow-loris peer that declared 200 MiB
    assert decoder.buffered_payload_bytes == 10


def test_wire_imports_neither_torch_nor_django():
    code = "import kcaas.wire, sys; assert 'torch' not in sys.modules and 'django' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
