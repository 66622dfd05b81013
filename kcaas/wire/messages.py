"""Typed messages of the data-plane wire format: validation shared by both sides, requests and responses per opcode.

Built on the frame layer (kcaas/wire/frames.py: header, opcodes, error codes, incremental decoder), which never
imports this module. `kcaas.wire` re-exports both layers: import from there. Byte layout and semantics:
docs/protocol.md.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kcaas.spec import KVCacheSpec, SpecError
from kcaas.wire.events import EventsOk, parse_events_ok
from kcaas.wire.fields import _bad, _bool_list, _check_keys, _int_field, _int_list, _str_field
from kcaas.wire.frames import (
    BATCH_BIT,
    DATA_OPS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_METADATA_BYTES,
    HEADER_SIZE,
    MAX_BATCH_SIZE,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_TOKENS_PER_SEQUENCE,
    OP_NAMES,
    TOKEN_ID_BYTES,
    Buffer,
    ErrorCode,
    Frame,
    FrameHead,
    Opcode,
    ProtocolError,
    _byte_view,
    encode_frame,
)

_LITTLE_ENDIAN = sys.byteorder == "little"


# ---- shared validation ----------------------------------------------------------------------------------------------
def pack_token_ids(tokens: Any) -> memoryview:
    """Token ids as int32 little-endian bytes (a view; no copy when given a native int32 buffer on a LE host).

    Accepts a sequence of ints, an array('i'), or any 1-D buffer of 4-byte signed ints (e.g. a numpy int32 array).
    Raises ProtocolError(BAD_TOKENS) for an id outside int32 or a non-integer.
    """
    if not isinstance(tokens, (list, tuple, range)):
        try:
            view = memoryview(tokens)
        except TypeError:
            view = None
        if view is not None and view.ndim == 1 and view.itemsize == 4 and view.format.lstrip("<=@") in ("i", "l"):
            if _LITTLE_ENDIAN and view.format[:1] != ">" and view.c_contiguous:
                return view.cast("B")
            tokens = view.tolist()
        elif view is not None:
            tokens = view.tolist()
    try:
        arr = array("i", tokens)  # C-speed range and type check (floats and strings raise; bools are 0/1)
    except (OverflowError, TypeError, ValueError):
        raise _bad(ErrorCode.BAD_TOKENS, "token ids must be integers in int32 range") from None
    if not _LITTLE_ENDIAN:  # pragma: no cover - no big-endian CI
        arr.byteswap()
    return memoryview(arr).cast("B")


def unpack_token_ids(buf: Buffer) -> memoryview:
    """int32 little-endian bytes -> a memoryview of format 'i' (zero copy on little-endian hosts)."""
    view = _byte_view(buf)
    if view.nbytes % TOKEN_ID_BYTES:
        raise _bad(ErrorCode.BAD_TOKENS, "token bytes are not a whole number of int32")
    if not _LITTLE_ENDIAN:  # pragma: no cover
        arr = array("i", bytes(view))
        arr.byteswap()
        return memoryview(arr)
    if view.nbytes == 0:
        return memoryview(array("i"))
    return view.cast("i")


def check_num_tokens(num_tokens: Any, *, request_id: int | None = None) -> int:
    valid = isinstance(num_tokens, int) and not isinstance(num_tokens, bool)
    if not valid or not 1 <= num_tokens <= MAX_TOKENS_PER_SEQUENCE:
        raise _bad(ErrorCode.BAD_TOKENS, f"a sequence holds 1..{MAX_TOKENS_PER_SEQUENCE} tokens", request_id)
    return num_tokens


def kv_nbytes(spec: KVCacheSpec, num_tokens: int) -> int:
    """Bytes of [num_layers, 2, num_tokens, num_kv_heads, head_dim] in spec.kv_dtype."""
    return spec.kv_bytes_per_token * num_tokens


_SPECS_SEEN: dict[tuple, KVCacheSpec] = {}  # identities already validated: a connection sends the same one again
_MAX_SPECS_SEEN = 256


def spec_from_wire(obj: Any, *, request_id: int | None = None) -> KVCacheSpec:
    """The identity dict of a request -> KVCacheSpec; INVALID_SPEC (or BAD_REQUEST if not an object) otherwise.
    Valid identities are remembered (bounded) by their exact fields and types, so a repeated one is not validated
    again."""
    if not isinstance(obj, dict):
        raise _bad(ErrorCode.BAD_REQUEST, "identity must be an object", request_id)
    try:
        key = tuple((name, type(value), value) for name, value in obj.items())
        hash(key)
    except TypeError:
        key = None  # a list or object among the values: not remembered (from_dict refuses it below)
    spec = _SPECS_SEEN.get(key) if key is not None else None
    if spec is not None:
        return spec
    try:
        spec = KVCacheSpec.from_dict(obj)
    except (SpecError, TypeError) as exc:
        raise _bad(ErrorCode.INVALID_SPEC, str(exc)[:MAX_ERROR_MESSAGE_CHARS], request_id) from None
    if key is not None:
        if len(_SPECS_SEEN) >= _MAX_SPECS_SEEN:
            _SPECS_SEEN.clear()
        _SPECS_SEEN[key] = spec
    return spec


class _Segments:
    """A payload that may arrive as several buffers (a sink's): slice by absolute offset, zero copy when possible."""

    def __init__(self, views: tuple[memoryview, ...]):
        self.views = views
        self.starts = []
        pos = 0
        for v in views:
            self.starts.append(pos)
            pos += v.nbytes
        self.nbytes = pos

    def slice(self, offset: int, length: int) -> memoryview:
        if length == 0:
            return memoryview(b"")
        for start, view in zip(self.starts, self.views):
            if start <= offset and offset + length <= start + view.nbytes:
                return view[offset - start : offset - start + length]
        out = bytearray()  # the range spans buffers: join just that range
        for start, view in zip(self.starts, self.views):
            lo, hi = max(offset, start), min(offset + length, start + view.nbytes)
            if lo < hi:
                out += view[lo - start : hi - start]
        return memoryview(out)


# ---- requests -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    request_id: int
    cache_id: str  # the cache this connection wants to use (the token's audience must be cache:<cache_id>)
    token: str  # the short-lived data token (JWT) from POST /api/v1/caches/{id}/tokens
    client: str  # free-form client name/version, for logs and metrics
    identity: KVCacheSpec | None = None  # the engine's layout, checked once for the session (requests may omit it)
    max_answer_bytes: int | None = None  # the largest GET answer frame the client takes (None: max_frame_bytes)


def encode_hello(
    request_id: int,
    *,
    cache_id: str,
    token: str,
    client: str = "kcaas-py/0.1",
    identity: KVCacheSpec | None = None,
    max_answer_bytes: int | None = None,
) -> list[Buffer]:
    meta: dict[str, Any] = {"cache_id": cache_id, "token": token, "client": client}
    if identity is not None:
        meta["identity"] = identity.to_dict()
    if max_answer_bytes is not None:
        meta["max_answer_bytes"] = max_answer_bytes
    return encode_frame(Opcode.HELLO, request_id, meta)


def parse_hello(frame: Frame) -> Hello:
    if frame.opcode != Opcode.HELLO:
        raise ValueError("not a HELLO frame")
    meta, rid = frame.meta, frame.request_id
    _check_keys(meta, {"cache_id", "token", "client", "identity", "max_answer_bytes"}, rid)
    client = meta.get("client", "")
    if not isinstance(client, str) or len(client) > 256:
        raise _bad(ErrorCode.BAD_REQUEST, "client must be a string of at most 256 chars", rid)
    identity = spec_from_wire(meta["identity"], request_id=rid) if "identity" in meta else None
    answers = _int_field(meta, "max_answer_bytes", rid, lo=HEADER_SIZE) if "max_answer_bytes" in meta else None
    return Hello(
        rid, _str_field(meta, "cache_id", rid), _str_field(meta, "token", rid, max_len=16384), client, identity, answers
    )


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What a data request's metadata says, validated: enough to size (or refuse) its payload before it arrives."""

    opcode: Opcode
    request_id: int
    cache_id: str
    identity: KVCacheSpec  # the client's claim (or its session's, checked at HELLO): the node checks it
    num_tokens: tuple[int, ...]  # tokens per sequence (one for the single forms)
    kv_start: tuple[int, ...]  # PUT/GET: the first token whose KV travels (0 unless resuming a long sequence)
    op: str  # "lookup", "put", "get" or "delete", for the single and the batch form alike
    identity_sent: bool = True  # False: the request left it out and uses its session's, checked at HELLO

    @property
    def is_batch(self) -> bool:
        return bool(self.opcode & BATCH_BIT)

    @property
    def carries_kv(self) -> bool:
        return self.op == "put"

    @property
    def token_bytes(self) -> int:
        return TOKEN_ID_BYTES * sum(self.num_tokens)

    @property
    def kv_bytes(self) -> tuple[int, ...]:
        """PUT: bytes of KV per sequence in the payload (tokens kv_start..num_tokens); () for other ops."""
        if not self.carries_kv:
            return ()
        return tuple(kv_nbytes(self.identity, n - s) for n, s in zip(self.num_tokens, self.kv_start))

    @property
    def payload_len(self) -> int:
        return self.token_bytes + sum(self.kv_bytes)


@dataclass(frozen=True, slots=True)
class DataRequest:
    head: RequestHead
    token_ids: tuple[memoryview, ...]  # int32 views into the payload, one per sequence
    kv: tuple[memoryview, ...]  # PUT: raw KV bytes per sequence ([L, 2, n - kv_start, H, D] kv_dtype, C order)

    def __getattr__(self, name: str) -> Any:  # head's fields read through: request.cache_id, request.op, ...
        return getattr(self.head, name)


def encode_request(
    opcode: Opcode,
    request_id: int,
    *,
    cache_id: str,
    identity: KVCacheSpec | None,
    token_ids: Sequence[Any],
    kv: Sequence[Any] | None = None,
    kv_start: Sequence[int] | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    session_identity: KVCacheSpec | None = None,
) -> list[Buffer]:
    """A LOOKUP/PUT/GET/DELETE frame (or a batch form): one token sequence per entry of token_ids.

    kv (PUT only): one buffer per sequence (or a list of buffers that follow each), the KV of tokens[kv_start:] in
    the engine layout, C order.
    identity None: the request leaves it out and the node uses the one the session's HELLO carried (checked there
    once); `session_identity` is that identity, which sizes the KV here.
    """
    if identity is None and session_identity is None:
        raise ValueError("a request without identity needs its session's (sent with HELLO)")
    opcode = Opcode(opcode)
    if opcode not in DATA_OPS:
        raise ValueError(f"{opcode.name} is not a data request")
    batch = bool(opcode & BATCH_BIT)
    n_seq = len(token_ids)
    if not (1 <= n_seq <= MAX_BATCH_SIZE if batch else n_seq == 1):
        raise ValueError(f"{opcode.name} takes {'1..%d sequences' % MAX_BATCH_SIZE if batch else 'one sequence'}")
    token_views = [pack_token_ids(t) for t in token_ids]
    num_tokens = [check_num_tokens(v.nbytes // TOKEN_ID_BYTES) for v in token_views]
    meta: dict[str, Any] = {"cache_id": cache_id, "num_tokens": num_tokens}
    if identity is not None:
        meta["identity"] = identity.to_dict()
    layout = identity if identity is not None else session_identity
    assert layout is not None  # one of them, checked above
    op = OP_NAMES[Opcode(opcode & ~BATCH_BIT)]
    payload: list[Any] = list(token_views)
    if op in ("put", "get"):
        starts = list(kv_start) if kv_start is not None else [0] * n_seq
        if len(starts) != n_seq or any(not 0 <= s <= n for s, n in zip(starts, num_tokens)):
            raise ValueError("kv_start must hold one offset in [0, num_tokens] per sequence")
        if any(starts):
            meta["kv_start"] = starts
    elif kv_start is not None:
        raise ValueError("kv_start is for put/get")
    if op == "put":
        if kv is None or len(kv) != n_seq:
            raise ValueError("put needs one KV buffer per sequence")
        for parts, n, s in zip(kv, num_tokens, starts):  # a buffer, or a list of buffers sent back to back
            views = [_byte_view(part) for part in (parts if isinstance(parts, list) else [parts])]
            if sum(view.nbytes for view in views) != kv_nbytes(layout, n - s):
                raise ValueError(f"KV of {n - s} tokens must be {kv_nbytes(layout, n - s)} bytes")
            payload += views
    elif kv is not None:
        raise ValueError("only put carries KV")
    return encode_frame(opcode, request_id, meta, payload, max_frame_bytes=max_frame_bytes)


_REQUEST_FIELDS = {
    op: frozenset({"cache_id", "identity", "num_tokens"} | ({"kv_start"} if op in ("put", "get") else set()))
    for op in OP_NAMES.values()
}
_OP_OF = {int(opcode): OP_NAMES[Opcode(opcode & ~BATCH_BIT)] for opcode in DATA_OPS}


def parse_request_head(head: FrameHead | Frame, session_identity: KVCacheSpec | None = None) -> RequestHead:
    """Validate a data request's metadata (and its declared payload length) before the payload is read.

    A request without `identity` takes `session_identity` (what its session's HELLO carried, checked there); with
    neither it is refused (BAD_REQUEST)."""
    rid, meta, opcode = head.request_id, head.meta, head.opcode
    op = _OP_OF.get(opcode)
    if op is None:
        raise ValueError(f"{Opcode(opcode).name} is not a data request")
    batch = bool(opcode & BATCH_BIT)
    _check_keys(meta, _REQUEST_FIELDS[op], rid)
    cache_id = _str_field(meta, "cache_id", rid)
    counts = meta.get("num_tokens")
    if not isinstance(counts, list) or not (1 <= len(counts) <= MAX_BATCH_SIZE if batch else len(counts) == 1):
        raise _bad(
            ErrorCode.BAD_REQUEST,
            f"num_tokens must list {'1..%d' % MAX_BATCH_SIZE if batch else '1'} token counts",
            rid,
        )
    num_tokens = tuple(check_num_tokens(n, request_id=rid) for n in counts)
    identity_sent = "identity" in meta
    if identity_sent:
        identity = spec_from_wire(meta["identity"], request_id=rid)
    elif session_identity is not None:
        identity = session_identity
    else:
        raise _bad(ErrorCode.BAD_REQUEST, "identity missing: send it with HELLO (once) or with every request", rid)
    if "kv_start" in meta:
        kv_start = _int_list(meta, "kv_start", len(num_tokens), rid)
        if any(s > n for s, n in zip(kv_start, num_tokens)):
            raise _bad(ErrorCode.BAD_REQUEST, "kv_start must not exceed num_tokens", rid)
    else:
        kv_start = (0,) * len(num_tokens)
    request = RequestHead(opcode, rid, cache_id, identity, num_tokens, kv_start, op, identity_sent)
    payload_len = head.payload_len
    if payload_len != request.payload_len:
        raise _bad(
            ErrorCode.PAYLOAD_LENGTH_MISMATCH,
            f"payload is {payload_len} bytes, the metadata implies {request.payload_len}",
            rid,
        )
    return request


def parse_request(frame: Frame, head: RequestHead | None = None) -> DataRequest:
    """A data request frame -> DataRequest (token ids and KV as views into the received payload)."""
    head = head or parse_request_head(frame)
    segments = _Segments(frame.payload)
    if frame.discarded or segments.nbytes != head.payload_len:
        raise _bad(ErrorCode.PAYLOAD_LENGTH_MISMATCH, "payload was not received", frame.request_id)
    token_views, pos = [], 0
    for n in head.num_tokens:
        token_views.append(unpack_token_ids(segments.slice(pos, n * TOKEN_ID_BYTES)))
        pos += n * TOKEN_ID_BYTES
    kv_views = []
    for size in head.kv_bytes:
        kv_views.append(segments.slice(pos, size))
        pos += size
    return DataRequest(head, tuple(token_views), tuple(kv_views))


# ---- responses ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HelloOk:
    cache_id: str
    identity: KVCacheSpec  # the cache's identity: the SDK checks its engine's against it before any put/get
    epoch: int  # the cache's placement epoch on this node (fencing: a MOVED carries a higher one)
    node_id: str
    max_frame_bytes: int  # the node's limits: the SDK splits batches / uses kv_start to stay within them
    max_metadata_bytes: int
    max_answer_bytes: int | None = None  # GET answers may be this large (a client that offered it in HELLO)


@dataclass(frozen=True, slots=True)
class LookupOk:
    num_cached: tuple[int, ...]  # leading tokens cached, per sequence


@dataclass(frozen=True, slots=True)
class PutOk:
    num_cached: tuple[int, ...]  # leading tokens cached after the put (== num_tokens unless out_of_space)
    num_written: tuple[int, ...]  # tokens whose KV this put wrote (the rest were cached: deduplicated)
    out_of_space: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class GetOk:
    num_cached: tuple[int, ...]  # the longest cached prefix, per sequence
    kv_start: tuple[int, ...]  # kv[i] holds the KV of tokens kv_start[i]..kv_end[i] of sequence i
    kv_end: tuple[int, ...]  # <= num_cached: less when the frame would exceed max_frame_bytes (ask again from here)
    kv: tuple[memoryview, ...]  # [num_layers, 2, kv_end - kv_start, num_kv_heads, head_dim] kv_dtype, C order


@dataclass(frozen=True, slots=True)
class DeleteOk:
    num_removed_blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ErrorReply:
    code: str
    message: str
    details: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Moved:
    cache_id: str
    endpoint: str  # where the cache is served now (host:port)
    epoch: int  # its new epoch: get a fresh data token for it, HELLO there, retry


Response = HelloOk | LookupOk | PutOk | GetOk | DeleteOk | ErrorReply | Moved


def encode_hello_ok(
    request_id: int,
    *,
    cache_id: str,
    identity: KVCacheSpec,
    epoch: int,
    node_id: str,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES,
    max_answer_bytes: int | None = None,
) -> list[Buffer]:
    meta = {
        "op": "hello",
        "cache_id": cache_id,
        "identity": identity.to_dict(),
        "epoch": epoch,
        "node_id": node_id,
        "max_frame_bytes": max_frame_bytes,
        "max_metadata_bytes": max_metadata_bytes,
    }
    if max_answer_bytes is not None:  # only to a client that offered it: an older one refuses unknown fields
        meta["max_answer_bytes"] = max_answer_bytes
    return encode_frame(Opcode.OK, request_id, meta)


def encode_lookup_ok(request_id: int, num_cached: Sequence[int]) -> list[Buffer]:
    return encode_frame(Opcode.OK, request_id, {"op": "lookup", "num_cached": list(num_cached)})


def encode_put_ok(
    request_id: int, *, num_cached: Sequence[int], num_written: Sequence[int], out_of_space: Sequence[bool]
) -> list[Buffer]:
    meta = {
        "op": "put",
        "num_cached": list(num_cached),
        "num_written": list(num_written),
        "out_of_space": [bool(x) for x in out_of_space],
    }
    return encode_frame(Opcode.OK, request_id, meta)


def encode_get_ok(
    request_id: int,
    *,
    spec: KVCacheSpec,
    num_cached: Sequence[int],
    kv_start: Sequence[int],
    kv_end: Sequence[int],
    kv: Sequence[Any],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> list[Buffer]:
    # each sequence's KV: one buffer, or a list of buffers sent back to back (a node's runs straight from its pool)
    if not len(num_cached) == len(kv_start) == len(kv_end) == len(kv):
        raise ValueError("one num_cached, kv_start, kv_end and KV buffer per sequence")
    views: list[memoryview] = []
    per_token = spec.kv_bytes_per_token
    for parts, s, e, n in zip(kv, kv_start, kv_end, num_cached):
        size = 0
        for part in parts if isinstance(parts, list) else (parts,):
            view = _byte_view(part)
            if view.nbytes:
                views.append(view)
                size += view.nbytes
        if not 0 <= e <= n or s < 0 or size != per_token * max(e - s, 0):
            raise ValueError("KV buffer sizes must match kv_end - kv_start tokens of the spec, kv_end <= num_cached")
    meta = {"op": "get", "num_cached": list(num_cached), "kv_start": list(kv_start), "kv_end": list(kv_end)}
    return encode_frame(Opcode.OK, request_id, meta, views, max_frame_bytes=max_frame_bytes)


def get_kv_end(
    spec: KVCacheSpec,
    num_cached: Sequence[int],
    kv_start: Sequence[int],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    metadata_allowance: int = 4096 + 64 * MAX_BATCH_SIZE,
) -> list[int]:
    """The node's side of a long GET: how far each sequence's KV can go so the response fits in one frame."""
    budget = max_frame_bytes - HEADER_SIZE - metadata_allowance
    ends = []
    for n, s in zip(num_cached, kv_start):
        take = max(0, min(n - s, budget // spec.kv_bytes_per_token))
        budget -= kv_nbytes(spec, take)
        ends.append(s + take if n >= s else n)
    return ends


def encode_delete_ok(request_id: int, num_removed_blocks: Sequence[int]) -> list[Buffer]:
    return encode_frame(Opcode.OK, request_id, {"op": "delete", "num_removed_blocks": list(num_removed_blocks)})


def encode_error(request_id: int, code: str, message: str, details: dict | None = None) -> list[Buffer]:
    """An ERROR frame. `message` is for humans and is truncated; never put a traceback or secret in it."""
    meta: dict[str, Any] = {"code": str(code), "message": str(message)[:MAX_ERROR_MESSAGE_CHARS]}
    if details:
        meta["details"] = details
    return encode_frame(Opcode.ERROR, request_id, meta)


def encode_error_for(exc: BaseException, request_id: int | None) -> list[Buffer]:
    """The ERROR frame for an exception: its own code and message when it carries a `code` (ProtocolError,
    SpecError, IdentityMismatch), else INTERNAL with a fixed message (the exception text never leaves the node)."""
    rid = request_id if request_id is not None else getattr(exc, "request_id", None) or 0
    if isinstance(exc, ProtocolError):
        return encode_error(rid, exc.code, exc.message, exc.details)
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        fields = getattr(exc, "fields", None)
        details = {"fields": {k: list(v) for k, v in fields.items()}} if isinstance(fields, dict) else None
        return encode_error(rid, code, str(exc), details)
    return encode_error(rid, ErrorCode.INTERNAL, "internal error")


def encode_moved(request_id: int, *, cache_id: str, endpoint: str, epoch: int) -> list[Buffer]:
    return encode_frame(Opcode.MOVED, request_id, {"cache_id": cache_id, "endpoint": endpoint, "epoch": epoch})


def parse_response(
    frame: Frame, *, request_opcode: Opcode, num_sequences: int = 1, spec: KVCacheSpec | None = None
) -> Response | EventsOk:
    """A response frame to the request it answers -> a typed result. ERROR and MOVED come back as values (the SDK
    decides what to raise or retry); a malformed response raises ProtocolError (the node misbehaves: close)."""
    meta, rid = frame.meta, frame.request_id
    if frame.opcode == Opcode.ERROR:
        _check_keys(meta, {"code", "message", "details"}, rid)
        details = meta.get("details", {})
        message = meta.get("message", "")
        if not isinstance(details, dict) or not isinstance(message, str):
            raise _bad(ErrorCode.BAD_METADATA, "malformed ERROR frame", rid)
        return ErrorReply(_str_field(meta, "code", rid, max_len=64), message, details)
    if frame.opcode == Opcode.MOVED:
        _check_keys(meta, {"cache_id", "endpoint", "epoch"}, rid)
        return Moved(
            _str_field(meta, "cache_id", rid),
            _str_field(meta, "endpoint", rid, max_len=1024),
            _int_field(meta, "epoch", rid),
        )
    if frame.opcode != Opcode.OK:
        raise _bad(ErrorCode.BAD_METADATA, f"{frame.opcode.name} is not a response", rid)
    request_opcode = Opcode(request_opcode)
    op = "hello" if request_opcode == Opcode.HELLO else OP_NAMES[Opcode(request_opcode & ~BATCH_BIT)]
    if meta.get("op") != op:
        raise _bad(ErrorCode.BAD_METADATA, f"an OK for {meta.get('op')!r} answers a {op} request", rid)
    n = num_sequences
    if op == "events":
        return parse_events_ok(frame)
    if op != "get" and frame.payload_len:
        raise _bad(ErrorCode.PAYLOAD_LENGTH_MISMATCH, f"an OK for {op} carries no payload", rid)
    if op == "hello":
        _check_keys(
            meta,
            {
                "op",
                "cache_id",
                "identity",
                "epoch",
                "node_id",
                "max_frame_bytes",
                "max_metadata_bytes",
                "max_answer_bytes",
            },
            rid,
        )
        answers = _int_field(meta, "max_answer_bytes", rid, lo=HEADER_SIZE) if "max_answer_bytes" in meta else None
        return HelloOk(
            _str_field(meta, "cache_id", rid),
            spec_from_wire(meta.get("identity"), request_id=rid),
            _int_field(meta, "epoch", rid),
            _str_field(meta, "node_id", rid),
            _int_field(meta, "max_frame_bytes", rid, lo=HEADER_SIZE),
            _int_field(meta, "max_metadata_bytes", rid),
            answers,
        )
    if op == "lookup":
        _check_keys(meta, {"op", "num_cached"}, rid)
        return LookupOk(_int_list(meta, "num_cached", n, rid))
    if op == "put":
        _check_keys(meta, {"op", "num_cached", "num_written", "out_of_space"}, rid)
        return PutOk(
            _int_list(meta, "num_cached", n, rid),
            _int_list(meta, "num_written", n, rid),
            _bool_list(meta, "out_of_space", n, rid),
        )
    if op == "delete":
        _check_keys(meta, {"op", "num_removed_blocks"}, rid)
        return DeleteOk(_int_list(meta, "num_removed_blocks", n, rid))
    # get
    if spec is None:
        raise ValueError("parsing a GET response needs the spec (to size its KV)")
    _check_keys(meta, {"op", "num_cached", "kv_start", "kv_end"}, rid)
    num_cached = _int_list(meta, "num_cached", n, rid)
    kv_start = _int_list(meta, "kv_start", n, rid)
    kv_end = _int_list(meta, "kv_end", n, rid)
    if any(e > c for e, c in zip(kv_end, num_cached)):
        raise _bad(ErrorCode.BAD_METADATA, "kv_end exceeds num_cached", rid)
    sizes = [kv_nbytes(spec, max(e - s, 0)) for s, e in zip(kv_start, kv_end)]
    if frame.discarded or frame.payload_len != sum(sizes):
        raise _bad(
            ErrorCode.PAYLOAD_LENGTH_MISMATCH,
            f"payload is {frame.payload_len} bytes, the metadata implies {sum(sizes)}",
            rid,
        )
    segments, pos, kv = _Segments(frame.payload), 0, []
    for size in sizes:
        kv.append(segments.slice(pos, size))
        pos += size
    return GetOk(num_cached, kv_start, kv_end, tuple(kv))


def get_response_sizes(meta: dict[str, Any], spec: KVCacheSpec) -> list[int] | None:
    """For a client's payload sink: the KV bytes per sequence a GET OK announces (None if the metadata is not a
    well-formed GET OK: let the decoder buffer it and parse_response report the problem)."""
    try:
        starts, ends = meta["kv_start"], meta["kv_end"]
        return [kv_nbytes(spec, max(int(e) - int(s), 0)) for s, e in zip(starts, ends, strict=True)]
    except (KeyError, TypeError, ValueError):
        return None
