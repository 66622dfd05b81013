"""The frame layer of the data-plane wire format: header, opcodes, error codes, frame encoding and the sans-I/O
decoder. Framed binary messages over one TLS (or Unix-socket) stream.

The bottom of the wire format: it imports nothing of KCaaS. The typed messages (kcaas/wire/messages.py) are built
on it, and `kcaas.wire` re-exports both layers, so the SDK and the node agent import one surface and cannot drift
apart. It is pure Python (struct + memoryview + json): no torch, no numpy, no Django. The byte layout, the opcodes,
the error codes and the reasons for a framed protocol rather than HTTP are in docs/protocol.md; this docstring is
the short form.

A frame is::

    offset  size  field            (little-endian)
    0       4     magic            b"KCW\\x00"
    4       1     version          1
    5       1     opcode           Opcode
    6       2     flags            0 in version 1 (any other value is refused)
    8       8     request_id       u64, chosen by the client, echoed by the response (multiplexing)
    16      4     metadata_len     u32, <= max_metadata_bytes (64 KiB by default)
    20      4     reserved         0
    24      8     payload_len      u64, HEADER_SIZE + metadata_len + payload_len <= max_frame_bytes (256 MiB)
    32      m     metadata         UTF-8 JSON object
    32+m    p     payload          raw bytes: int32 LE token ids, then KV bytes (see the request helpers)

`FrameDecoder` is sans-I/O: feed it bytes, or ask it for a buffer to `recv_into`, and take complete frames. Every
length is checked against its bound before anything is allocated, and the payload of a large frame can be received
straight into the caller's destination (a staging tensor's memory) with no copy.

Two kinds of error, one exception type (`ProtocolError`, with a machine-readable `code`):
- raised by `FrameDecoder`: the stream itself is bad; answer ERROR (with `request_id` when known) and close.
- raised by the `parse_*` helpers: one request is bad, the stream is still in sync; answer ERROR and go on.
"""

from __future__ import annotations

import enum
import json
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MAGIC = b"KCW\x00"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQ")
HEADER_SIZE = HEADER.size  # 32
assert HEADER_SIZE == 32

DEFAULT_MAX_METADATA_BYTES = 64 * 1024
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_BATCH_SIZE = 1024  # sequences per batch request
MAX_TOKENS_PER_SEQUENCE = 1 << 22  # 4 Mi tokens; the frame size bounds real requests long before this
MAX_REQUEST_ID = (1 << 64) - 1
MAX_ERROR_MESSAGE_CHARS = 1024
TOKEN_ID_BYTES = 4  # int32 little-endian
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1

Buffer = bytes | bytearray | memoryview


class Opcode(enum.IntEnum):
    # requests (client -> node)
    HELLO = 0x01  # authenticate the connection for one cache with a data token
    LOOKUP = 0x02
    PUT = 0x03
    GET = 0x04
    DELETE = 0x05
    EVENTS = 0x06  # the cache's block events, numbered, from a given seq (kcaas/wire/events.py)
    LOOKUP_BATCH = 0x12  # batch forms: the same op over 1..MAX_BATCH_SIZE sequences (BATCH_BIT | op)
    PUT_BATCH = 0x13
    GET_BATCH = 0x14
    DELETE_BATCH = 0x15
    # responses (node -> client), echoing the request's request_id
    OK = 0x80
    ERROR = 0x81
    MOVED = 0x82


BATCH_BIT = 0x10
_SINGLE_OPS = (Opcode.LOOKUP, Opcode.PUT, Opcode.GET, Opcode.DELETE)
DATA_OPS = frozenset(_SINGLE_OPS + tuple(Opcode(BATCH_BIT | op) for op in _SINGLE_OPS))
# Frames whose payload must be empty: the decoder refuses a non-zero payload_len for them before allocating.
NO_PAYLOAD_OPS = frozenset({Opcode.HELLO, Opcode.EVENTS, Opcode.ERROR, Opcode.MOVED})
_OPCODES = {int(op): op for op in Opcode}
OP_NAMES = {
    Opcode.HELLO: "hello",
    Opcode.LOOKUP: "lookup",
    Opcode.PUT: "put",
    Opcode.GET: "get",
    Opcode.DELETE: "delete",
    Opcode.EVENTS: "events",
}


class ErrorCode(enum.StrEnum):
    """Machine-readable error codes. The first group comes from this module; the second from the node's logic."""

    # the stream (FrameDecoder): answer ERROR, then close
    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OPCODE = "unknown_opcode"
    BAD_HEADER = "bad_header"  # non-zero flags or reserved field
    METADATA_TOO_LARGE = "metadata_too_large"
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_METADATA = "bad_metadata"  # not UTF-8, not JSON, not an object, duplicate keys, NaN/Infinity
    TRUNCATED_FRAME = "truncated_frame"  # the stream ended inside a frame
    TRAILING_BYTES = "trailing_bytes"  # decode_frame: bytes after the frame
    # one request (parse_* helpers): answer ERROR, keep the connection
    BAD_REQUEST = "bad_request"  # a field missing, of the wrong type or out of range
    BAD_TOKENS = "bad_tokens"  # token counts out of range, or ids that are not int32
    PAYLOAD_LENGTH_MISMATCH = "payload_length_mismatch"  # payload_len != what the metadata implies
    INVALID_SPEC = "invalid_spec"  # the identity is invalid on its own (SpecError)
    # the node's logic (listed here so both sides share one vocabulary)
    IDENTITY_MISMATCH = "identity_mismatch"
    PREFIX_NOT_CACHED = "prefix_not_cached"  # a PUT with kv_start > 0 whose tokens[:kv_start] are not all cached
    UNAUTHENTICATED = "unauthenticated"  # no HELLO for this cache on this connection, or a bad token
    TOKEN_EXPIRED = "token_expired"
    FORBIDDEN = "forbidden"  # e.g. a read token on put/delete
    NOT_FOUND = "not_found"  # no such cache here (deliberately the same answer for "another tenant's")
    OVERLOADED = "overloaded"  # backpressure or concurrency limit: retry later (details.retry_after_ms)
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"  # never carries the exception text


class ProtocolError(Exception):
    """A wire-level error with a machine-readable `code`; `request_id` is set when the frame header was readable."""

    def __init__(self, code: str, message: str, *, request_id: int | None = None, details: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code = str(code)
        self.message = message
        self.request_id = request_id
        self.details = details or {}


# ---- frames -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FrameHead:
    """A frame's header and metadata, known before its payload arrives (what a payload sink decides on)."""

    opcode: Opcode
    flags: int
    request_id: int
    meta: dict[str, Any]
    payload_len: int


@dataclass(frozen=True, slots=True)
class Frame:
    opcode: Opcode
    request_id: int
    meta: dict[str, Any]
    payload: tuple[memoryview, ...] = ()  # one view when the decoder buffered it; the sink's views otherwise
    flags: int = 0
    discarded: bool = False  # the payload sink chose DISCARD (or raised): payload is () though it was not empty
    error: ProtocolError | None = None  # what the payload sink raised for this frame: answer ERROR, stay connected

    @property
    def payload_len(self) -> int:
        return sum(view.nbytes for view in self.payload)


def _byte_view(buf: Any) -> memoryview:
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
        return buf  # already what the frame layer sends (the node's pool views): the common case, nothing to make
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("payload buffers must be C-contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def encode_frame(
    opcode: Opcode,
    request_id: int,
    meta: dict[str, Any],
    payload: Sequence[Any] = (),
    *,
    flags: int = 0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
) -> list[Buffer]:
    """[header + metadata, *payload views]: hand the list to socket.sendmsg / writelines, nothing is joined.

    Payload items are any C-contiguous buffers (bytes, memoryview, array, a numpy array, a tensor's numpy view).
    """
    if type(opcode) is not Opcode:
        opcode = Opcode(opcode)
    if flags != 0:
        raise ValueError("no flags are defined in version 1")
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id must fit in a u64, got {request_id}")
    if not isinstance(meta, dict):
        raise ValueError("metadata must be a JSON object")
    meta_bytes = _ENCODER.encode(meta).encode()
    views = [_byte_view(p) for p in payload]
    views = [v for v in views if v.nbytes]
    payload_len = sum(v.nbytes for v in views)
    if len(meta_bytes) > max_metadata_bytes:
        raise ProtocolError(ErrorCode.METADATA_TOO_LARGE, f"{len(meta_bytes)} bytes > {max_metadata_bytes}")
    if HEADER_SIZE + len(meta_bytes) + payload_len > max_frame_bytes:
        total = HEADER_SIZE + len(meta_bytes) + payload_len
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"{total} > {max_frame_bytes}")
    if payload_len and opcode in NO_PAYLOAD_OPS:
        raise ValueError(f"{opcode.name} frames carry no payload")
    head = HEADER.pack(MAGIC, VERSION, opcode, flags, request_id, len(meta_bytes), 0, payload_len)
    return [head + meta_bytes, *views]


class _Discard:
    def __repr__(self) -> str:
        return "DISCARD"


DISCARD = _Discard()
PayloadSink = Callable[[FrameHead], Any]

_HEADER, _META, _PAYLOAD, _FAILED = range(4)
_SCRATCH_BYTES = 64 * 1024
_ZERO_COPY_MIN = 4096  # get_buffer hands out the sink's own memory when at least this much payload remains


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return obj


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)  # one, not one per call


def decode_metadata(raw: Buffer, *, request_id: int | None = None) -> dict[str, Any]:
    try:
        meta = _DECODER.decode(str(raw, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        message = f"metadata is not valid UTF-8 JSON ({type(exc).__name__})"
        raise ProtocolError(ErrorCode.BAD_METADATA, message, request_id=request_id) from None
    if not isinstance(meta, dict):
        raise ProtocolError(ErrorCode.BAD_METADATA, "metadata must be a JSON object", request_id=request_id)
    return meta


class FrameDecoder:
    """Incremental, sans-I/O frame parser for one stream.

    Two ways to give it bytes (both may be mixed):
    - `feed(data)`: copies `data` in (what a protocol's data_received does);
    - `view = get_buffer()`, `n = sock.recv_into(view)`, `buffer_updated(n)` (asyncio.BufferedProtocol's shape).
      While a large payload is being received into a sink's buffer, `get_buffer` returns that buffer itself, so the
      bytes go from the socket into their destination with no copy.
    Complete frames come out of `next_frame()` / `frames()` in stream order.

    Allocation is bounded by construction: the 32-byte header is validated first; the metadata buffer is allocated
    only once its length is within `max_metadata_bytes`; the payload buffer only once the whole frame is within
    `max_frame_bytes`. Without a sink, the decoder's own payload buffer grows with the bytes actually received, so a
    peer that declares 256 MiB and sends 10 bytes costs 10 bytes, not 256 MiB.

    `payload_sink(head) -> None | buffer | [buffers] | DISCARD` is called once per frame with a non-empty payload, after
    its metadata: None lets the decoder buffer the payload; writable buffers whose sizes add up to payload_len
    receive it in order (zero copy: e.g. [token buffer, staging tensor memory]); DISCARD drops it (a request the node
    already refused: the stream stays in sync without storing anything).

    After any ProtocolError the decoder is failed: every later call raises the same error.
    """

    def __init__(
        self,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
        payload_sink: PayloadSink | None = None,
    ):
        if max_frame_bytes < HEADER_SIZE or max_metadata_bytes < 0:
            raise ValueError("max_frame_bytes must hold a header and max_metadata_bytes be >= 0")
        self.max_frame_bytes = max_frame_bytes
        self.max_metadata_bytes = max_metadata_bytes
        self.payload_sink = payload_sink
        self._frames: deque[Frame] = deque()
        self._error: ProtocolError | None = None
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._reset()

    # ---- state --------------------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._state = _HEADER
        self._header = bytearray(HEADER_SIZE)
        self._target: memoryview = memoryview(self._header)  # what the current phase fills
        self._filled = 0
        self._head: FrameHead | None = None
        self._opcode: Opcode | None = None
        self._request_id: int | None = None
        self._flags = 0
        self._meta_len = 0
        self._payload_len = 0
        self._payload_got = 0
        self._grow: bytearray | None = None  # the decoder's own payload buffer (no sink)
        self._sink_views: list[memoryview] = []
        self._sink_index = 0
        self._discard = False
        self._meta: dict[str, Any] = {}
        self._sink_error: ProtocolError | None = None
        self._direct = False

    @property
    def in_frame(self) -> bool:
        """True when part of a frame has arrived (an EOF now would truncate it)."""
        return self._state != _HEADER or self._filled > 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes the decoder holds for the frame in progress: header, metadata, its own payload buffer (the scratch
        buffer for get_buffer and a sink's buffers are not counted). Never above max_frame_bytes."""
        meta = self._target.nbytes if self._state == _META else 0
        return HEADER_SIZE + meta + self.buffered_payload_bytes

    @property
    def buffered_payload_bytes(self) -> int:
        """Bytes the decoder itself holds for the frame in progress (tests assert this stays within bounds)."""
        return len(self._grow) if self._grow is not None else 0

    def _fail(self, code: str, message: str) -> None:
        self._error = ProtocolError(code, message, request_id=self._request_id)
        self._state = _FAILED
        raise self._error

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- input --------------------------------------------------------------------------------------------------
    def feed(self, data: Any) -> None:
        self._check()
        view = _byte_view(data)
        pos, end = 0, view.nbytes
        while pos < end:
            if self._state == _PAYLOAD:
                pos += self._take_payload(view[pos:end])
            else:
                k = min(self._target.nbytes - self._filled, end - pos)
                self._target[self._filled : self._filled + k] = view[pos : pos + k]
                self._filled += k
                pos += k
                if self._filled == self._target.nbytes:
                    self._advance()

    def get_buffer(self) -> memoryview:
        """A writable view to receive into; pass the count received to buffer_updated()."""
        self._check()
        if self._state == _PAYLOAD and not self._discard and self._grow is None:
            target = self._sink_views[self._sink_index]
            remaining = target.nbytes - self._filled
            if remaining >= _ZERO_COPY_MIN:
                self._direct = True
                return target[self._filled :]
        self._direct = False
        return memoryview(self._scratch)

    @property
    def payload_received(self) -> int:
        """Bytes of the current frame's payload received so far (0 outside a payload: a complete frame resets it)."""
        return self._payload_got if self._state == _PAYLOAD else 0

    @property
    def buffer_is_payload(self) -> bool:
        """The last get_buffer() handed out the payload sink's own memory: a reader may fill more of it (several
        reads) before one buffer_updated() with the total."""
        return self._direct

    def buffer_updated(self, nbytes: int) -> None:
        self._check()
        if self._direct:
            self._direct = False
            target = self._sink_views[self._sink_index]
            if not 0 <= nbytes <= target.nbytes - self._filled:
                raise ValueError("nbytes exceeds the buffer handed out")
            self._filled += nbytes
            self._payload_got += nbytes
            self._after_payload_bytes()
        else:
            if not 0 <= nbytes <= len(self._scratch):
                raise ValueError("nbytes exceeds the buffer handed out")
            self.feed(memoryview(self._scratch)[:nbytes])

    def eof(self) -> None:
        """The peer closed the stream: raises TRUNCATED_FRAME if it closed inside a frame."""
        self._check()
        if self.in_frame:
            self._fail(ErrorCode.TRUNCATED_FRAME, "the stream ended inside a frame")

    # ---- output -------------------------------------------------------------------------------------------------
    def next_frame(self) -> Frame | None:
        return self._frames.popleft() if self._frames else None

    def frames(self) -> Iterator[Frame]:
        while self._frames:
            yield self._frames.popleft()

    # ---- phases -------------------------------------------------------------------------------------------------
    def _advance(self) -> None:
        if self._state == _HEADER:
            self._parse_header()
        elif self._state == _META:
            self._parse_meta()

    def _parse_header(self) -> None:
        magic, version, opcode, flags, request_id, meta_len, reserved, payload_len = HEADER.unpack(self._header)
        if magic != MAGIC:
            self._fail(ErrorCode.BAD_MAGIC, "not a KCaaS data-plane stream")
        if version != VERSION:
            self._fail(ErrorCode.UNSUPPORTED_VERSION, f"version {version} (this side speaks {VERSION})")
        self._request_id = request_id
        if opcode not in _OPCODES:
            self._fail(ErrorCode.UNKNOWN_OPCODE, f"opcode 0x{opcode:02x}")
        if flags != 0 or reserved != 0:
            self._fail(ErrorCode.BAD_HEADER, "flags and reserved must be 0 in version 1")
        if meta_len > self.max_metadata_bytes:
            self._fail(ErrorCode.METADATA_TOO_LARGE, f"{meta_len} bytes > {self.max_metadata_bytes}")
        if HEADER_SIZE + meta_len + payload_len > self.max_frame_bytes:
            self._fail(ErrorCode.FRAME_TOO_LARGE, f"{HEADER_SIZE + meta_len + payload_len} > {self.max_frame_bytes}")
        self._opcode = _OPCODES[opcode]
        if payload_len and self._opcode in NO_PAYLOAD_OPS:
            self._fail(ErrorCode.PAYLOAD_LENGTH_MISMATCH, f"{self._opcode.name} frames carry no payload")
        self._flags, self._meta_len, self._payload_len = flags, meta_len, payload_len
        self._state = _META
        self._target = memoryview(bytearray(meta_len))  # bounded: meta_len <= max_metadata_bytes
        self._filled = 0
        if meta_len == 0:
            self._parse_meta()

    def _parse_meta(self) -> None:
        try:
            self._meta = decode_metadata(self._target, request_id=self._request_id)
        except ProtocolError as exc:
            self._fail(exc.code, exc.message)
        self._target = memoryview(b"")
        self._filled = 0
        if self._payload_len == 0:
            self._emit(())
            return
        self._state = _PAYLOAD
        self._payload_got = 0
        sink = None
        if self.payload_sink is not None:
            opcode, request_id = self._opcode, self._request_id
            assert opcode is not None and request_id is not None  # _parse_header set them
            head = FrameHead(opcode, self._flags, request_id, self._meta, self._payload_len)
            try:
                sink = self.payload_sink(head)
            except ProtocolError as exc:  # a bad request, not a bad stream: drop its payload, report it with the frame
                exc.request_id = self._request_id
                self._sink_error = exc
                sink = DISCARD
        if sink is DISCARD:
            self._discard = True
        elif sink is None:
            self._grow = bytearray()
        else:
            views = [memoryview(sink)] if not isinstance(sink, (list, tuple)) else [memoryview(s) for s in sink]
            views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
            if any(v.readonly for v in views) or sum(v.nbytes for v in views) != self._payload_len:
                raise ValueError("a payload sink must return writable buffers whose sizes add up to payload_len")
            self._sink_views = [v for v in views if v.nbytes]
            self._sink_index = 0

    def _take_payload(self, data: memoryview) -> int:
        k = min(self._payload_len - self._payload_got, data.nbytes)
        if self._discard:
            pass
        elif self._grow is not None:
            self._grow += data[:k]
        else:
            pos = 0
            while pos < k:
                target = self._sink_views[self._sink_index]
                n = min(target.nbytes - self._filled, k - pos)
                target[self._filled : self._filled + n] = data[pos : pos + n]
                self._filled += n
                pos += n
                if self._filled == target.nbytes and self._sink_index + 1 < len(self._sink_views):
                    self._sink_index += 1
                    self._filled = 0
        self._payload_got += k
        self._after_payload_bytes()
        return k

    def _after_payload_bytes(self) -> None:
        if self._grow is None and not self._discard:
            target = self._sink_views[self._sink_index]
            if self._filled == target.nbytes and self._sink_index + 1 < len(self._sink_views):
                self._sink_index += 1
                self._filled = 0
        if self._payload_got == self._payload_len:
            if self._discard:
                self._emit((), discarded=True)
            elif self._grow is not None:
                self._emit((memoryview(self._grow),))
            else:
                self._emit(tuple(self._sink_views))

    def _emit(self, payload: tuple[memoryview, ...], *, discarded: bool = False) -> None:
        opcode, request_id = self._opcode, self._request_id
        assert opcode is not None and request_id is not None  # _parse_header set them
        frame = Frame(opcode, request_id, self._meta, payload, self._flags, discarded, self._sink_error)
        self._frames.append(frame)
        self._reset()


def decode_frame(
    data: Buffer,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
) -> Frame:
    """Exactly one frame from `data` (TRUNCATED_FRAME if short, TRAILING_BYTES if longer)."""
    decoder = FrameDecoder(max_frame_bytes=max_frame_bytes, max_metadata_bytes=max_metadata_bytes)
    view = _byte_view(data)
    decoder.feed(view[:HEADER_SIZE])  # validates the header before anything else is read or allocated
    total = HEADER_SIZE
    if view.nbytes >= HEADER_SIZE:
        _, _, _, _, _, meta_len, _, payload_len = HEADER.unpack(view[:HEADER_SIZE])
        total = HEADER_SIZE + meta_len + payload_len
        decoder.feed(view[HEADER_SIZE:total])
    frame = decoder.next_frame()
    if frame is None:
        raise ProtocolError(ErrorCode.TRUNCATED_FRAME, "data ends inside a frame", request_id=decoder._request_id)
    if view.nbytes > total:
        message = f"{view.nbytes - total} bytes after the frame"
        raise ProtocolError(ErrorCode.TRAILING_BYTES, message, request_id=frame.request_id)
    return frame
