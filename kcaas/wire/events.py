"""The EVENTS exchange of the data plane: a tenant reads its cache's block events (vLLM's KV-event format,
kcaas.kv_events) from the node, numbered, with replay (docs/protocol.md, "EVENTS"; docs/routing.md).

    request  EVENTS  meta {"cache_id", "since", "max_batches"}                      no payload
    answer   OK      meta {"op": "events", "first_seq", "next_seq", "seqs", "sizes"}  payload: the batches back to back

`seqs[i]` numbers batch i, `sizes[i]` is its length in the payload; `first_seq` is the oldest batch the node still
keeps (a reader whose `since` is older missed some), `next_seq` the number the next batch will have. The session's
HELLO (a data token for the cache, read access suffices) authorizes it: a connection reads only the caches it
authenticated for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kcaas.wire.fields import _bad, _check_keys, _int_field, _str_field
from kcaas.wire.frames import Buffer, ErrorCode, Frame, Opcode, encode_frame

MAX_EVENT_BATCHES = 4096  # per answer


@dataclass(frozen=True, slots=True)
class EventsRequest:
    cache_id: str
    since: int
    max_batches: int


@dataclass(frozen=True, slots=True)
class EventsOk:
    first_seq: int
    next_seq: int
    batches: tuple[tuple[int, bytes], ...]  # (seq, payload), seq ascending


def encode_events_request(request_id: int, *, cache_id: str, since: int, max_batches: int) -> list[Buffer]:
    meta = {"cache_id": cache_id, "since": since, "max_batches": max_batches}
    return encode_frame(Opcode.EVENTS, request_id, meta, [])


def parse_events_request(frame: Frame) -> EventsRequest:
    """Raises ProtocolError (BAD_REQUEST) for metadata that is not an EVENTS request."""
    meta, rid = frame.meta, frame.request_id
    _check_keys(meta, {"cache_id", "since", "max_batches"}, rid)
    return EventsRequest(
        _str_field(meta, "cache_id", rid),
        _int_field(meta, "since", rid),
        _int_field(meta, "max_batches", rid, lo=1, hi=MAX_EVENT_BATCHES),
    )


def encode_events_ok(
    request_id: int, *, first_seq: int, next_seq: int, batches: tuple[tuple[int, bytes], ...]
) -> list[Buffer]:
    meta: dict[str, Any] = {
        "op": "events",
        "first_seq": first_seq,
        "next_seq": next_seq,
        "seqs": [seq for seq, _ in batches],
        "sizes": [len(payload) for _, payload in batches],
    }
    return encode_frame(Opcode.OK, request_id, meta, [payload for _, payload in batches])


def parse_events_ok(frame: Frame) -> EventsOk:
    """Raises ProtocolError when the answer's metadata and payload disagree (the node misbehaves: close)."""
    meta, rid = frame.meta, frame.request_id
    _check_keys(meta, {"op", "first_seq", "next_seq", "seqs", "sizes"}, rid)
    first, after = _int_field(meta, "first_seq", rid), _int_field(meta, "next_seq", rid)
    seqs, sizes = meta.get("seqs"), meta.get("sizes")
    if (
        not isinstance(seqs, list)
        or not isinstance(sizes, list)
        or len(seqs) != len(sizes)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seqs + sizes)
        or seqs != sorted(set(seqs))
        or any(not first <= s < after for s in seqs)
    ):
        raise _bad(ErrorCode.BAD_METADATA, "malformed EVENTS answer", rid)
    data = b"".join(bytes(view) for view in frame.payload)
    if frame.discarded or len(data) != sum(sizes):
        raise _bad(ErrorCode.PAYLOAD_LENGTH_MISMATCH, "the EVENTS answer's payload is not its batches", rid)
    batches, pos = [], 0
    for seq, size in zip(seqs, sizes):
        batches.append((seq, data[pos : pos + size]))
        pos += size
    return EventsOk(first, after, tuple(batches))
