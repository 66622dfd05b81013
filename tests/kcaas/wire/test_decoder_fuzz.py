"""Fuzzing the wire decoder and the request/response parsers: arbitrary bytes and mutated valid streams must give
ProtocolError or valid frames, never another exception, and the decoder never holds more than its bounds."""

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcaas import wire
from kcaas.spec import KVCacheSpec
from kcaas.wire import Opcode, ProtocolError

SPEC = KVCacheSpec("tiny", 2, 1, 2, 4, "float16", "float16")
MAX_FRAME, MAX_META = 2048, 512
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_stream() -> bytes:
    frames = [
        wire.encode_hello(1, cache_id="c", token="t"),
        wire.encode_request(
            Opcode.PUT_BATCH, 2, cache_id="c", identity=SPEC, token_ids=[[1, 2, 3], [4]], kv=[bytes(48), bytes(16)]
        ),
        wire.encode_request(Opcode.GET, 3, cache_id="c", identity=SPEC, token_ids=[[1, 2]], kv_start=[1]),
        wire.encode_get_ok(4, spec=SPEC, num_cached=[2], kv_start=[0], kv_end=[2], kv=[bytes(range(32))]),
        wire.encode_put_ok(5, num_cached=[3], num_written=[3], out_of_space=[False]),
        wire.encode_error(6, "overloaded", "later", {"retry_after_ms": 5}),
        wire.encode_moved(7, cache_id="c", endpoint="h:1", epoch=2),
        wire.encode_hello_ok(8, cache_id="c", identity=SPEC, epoch=1, node_id="n"),
    ]
    return b"".join(b"".join(bytes(b) for b in f) for f in frames)


VALID = valid_stream()


def check_frame(frame: wire.Frame) -> None:
    """A yielded frame is well-formed, and the typed parsers give a value or a ProtocolError, nothing else."""
    assert isinstance(frame.opcode, Opcode) and isinstance(frame.meta, dict)
    assert frame.payload_len <= MAX_FRAME - wire.HEADER_SIZE
    try:
        if frame.opcode == Opcode.HELLO:
            wire.parse_hello(frame)
        elif frame.opcode in wire.DATA_OPS:
            request = wire.parse_request(frame)
            assert sum(v.nbytes for v in request.kv) + 4 * sum(request.num_tokens) == frame.payload_len
        else:
            for request_opcode in (Opcode.HELLO, Opcode.LOOKUP, Opcode.PUT, Opcode.GET_BATCH, Opcode.DELETE):
                try:
                    wire.parse_response(frame, request_opcode=request_opcode, num_sequences=1, spec=SPEC)
                except ProtocolError:
                    pass
    except ProtocolError as exc:
        assert isinstance(exc.code, str) and exc.code


def run_decoder(data: bytes, cuts: list[int]) -> list[wire.Frame]:
    decoder = wire.FrameDecoder(max_frame_bytes=MAX_FRAME, max_metadata_bytes=MAX_META)
    frames, pos = [], 0
    bounds = sorted({min(c, len(data)) for c in cuts} | {len(data)})
    try:
        for end in bounds:
            decoder.feed(data[pos:end])
            pos = end
            assert decoder.allocated_bytes <= MAX_FRAME
            assert decoder.buffered_payload_bytes <= MAX_FRAME - wire.HEADER_SIZE
            frames.extend(decoder.frames())
        decoder.eof()
    except ProtocolError as exc:
        assert exc.code in set(wire.ErrorCode)
        frames.extend(decoder.frames())
    for frame in frames:
        check_frame(frame)
    return frames


@FUZZ
@given(st.binary(max_size=4096), st.lists(st.integers(0, 4096), max_size=8))
def test_arbitrary_bytes(data, cuts):
    run_decoder(data, cuts)


@FUZZ
@given(
    st.integers(0, 255),
    st.integers(0, 0xFFFF),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=3000),
    st.lists(st.integers(0, 4096), max_size=8),
)
def test_valid_magic_with_arbitrary_fields(opcode, flags, meta_len, payload_len, rest, cuts):
    meta_len, payload_len = meta_len % (MAX_META * 2), payload_len % (MAX_FRAME * 2)  # around the bounds
    header = wire.HEADER.pack(wire.MAGIC, 1, opcode, flags, 1, meta_len, 0, payload_len)
    run_decoder(header + rest, cuts)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, len(VALID) - 1), st.integers(0, 255)
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, len(VALID)),
    st.lists(st.integers(0, len(VALID)), max_size=8),
)
def test_mutated_valid_streams(mutations, truncate_at, cuts):
    data = bytearray(VALID)
    for kind, index, value in mutations:
        index %= max(len(data), 1)
        if kind == "flip" and data:
            data[index] ^= 1 << (value % 8)
        elif kind == "set" and data:
            data[index] = value
        elif kind == "insert":
            data.insert(index, value)
        elif data:
            del data[index]
    run_decoder(bytes(data[: max(truncate_at, 1)] if truncate_at < len(data) else data), cuts)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["cache_id", "identity", "num_tokens", "kv_start", "x"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-2, 2**40),
            st.text(max_size=5),
            st.lists(st.integers(-2, 40), max_size=3),
            st.just(SPEC.to_dict()),
        ),
    ),
    st.sampled_from(sorted(wire.DATA_OPS)),
    st.binary(max_size=200),
)
def test_request_metadata_fuzz(meta, opcode, payload):
    frame = wire.Frame(Opcode(opcode), 1, meta, (memoryview(payload),))
    try:
        request = wire.parse_request(frame)
    except ProtocolError:
        return
    assert 4 * sum(request.num_tokens) + sum(v.nbytes for v in request.kv) == len(payload)


def test_the_valid_stream_decodes_whole():
    frames = run_decoder(VALID, [])
    assert [f.request_id for f in frames] == [1, 2, 3, 4, 5, 6, 7, 8]
    hello = b"".join(bytes(b) for b in wire.encode_hello(1, cache_id="c", token="t"))
    assert struct.unpack("<I", VALID[16:20])[0] == len(hello) - wire.HEADER_SIZE
