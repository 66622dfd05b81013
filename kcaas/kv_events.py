"""vLLM's KV cache events as plain data, and their wire form (vllm/distributed/kv_events.py, `--kv-events-config`):
what an engine publishes when blocks enter or leave its cache, and what KCaaS reads and writes in the same shape.

Wire form (msgpack, as vLLM's msgspec structs encode it): a batch is an array `[ts, events, data_parallel_rank]`
(the rank nil when unset; a 2-element batch is read too); each event is a map tagged by its class name,
`{"type": "BlockStored", ...}`, the fields with a default omitted when they hold it. Over ZMQ a batch travels as
three frames `(topic, seq, payload)`, seq an 8-byte big-endian counter from 0; a replay request to the ROUTER
socket is the first seq wanted (8 bytes), answered by the buffered frames from it, then `(b"", END_SEQ, b"")`.

`BlockStored.token_ids` holds every token of the blocks it names (block_size each), `parent_block_hash` the block
before the first; block hashes are the engine's own (an int or bytes), opaque to a consumer. msgpack is imported
when a batch is decoded or encoded (the control plane's and the router's environments have it; an engine's need not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The media KCaaS names, fastest first: vLLM's three (device memory, its CPU offload tier, storage) and the fleet's
# network store (a KCaaS cache's network tier). The field is a free string in vLLM: a publisher may name others.
MEDIA = ("GPU", "CPU", "STORAGE", "NETWORK")
MAX_MEDIUM_CHARS = 16


class EventFormatError(ValueError):
    """A payload that is not a batch of vLLM KV events."""


BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block: what else its hash covers (salt, LoRA, media)
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def decode_batch(payload: bytes) -> EventBatch:
    """The batch a publisher sent. Raises EventFormatError for anything else (nothing of it is applied)."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for malformed input
        raise EventFormatError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise EventFormatError("a batch is [ts, events, data_parallel_rank?]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or not (rank is None or isinstance(rank, int)):
        raise EventFormatError("a batch's ts must be a number and its rank an integer")
    return EventBatch(float(ts), tuple(_decode_event(e) for e in events), rank)


def _decode_event(raw: Any) -> Event:
    if not isinstance(raw, dict):
        raise EventFormatError("an event is a map tagged with its type")
    kind = raw.get("type")
    try:
        if kind == "BlockStored":
            stored = BlockStored(
                block_hashes=_hashes(raw["block_hashes"]),
                parent_block_hash=_hash_or_none(raw["parent_block_hash"]),
                token_ids=tuple(_int(t) for t in raw["token_ids"]),
                block_size=_int(raw["block_size"]),
                medium=_medium(raw.get("medium")),
                lora_name=_str_or_none(raw.get("lora_name")),
                lora_id=raw.get("lora_id"),
                extra_keys=_extra_keys(raw.get("extra_keys")),
                group_idx=raw.get("group_idx"),
            )
            if stored.block_size < 1 or len(stored.token_ids) != stored.block_size * len(stored.block_hashes):
                raise EventFormatError("BlockStored must carry block_size tokens for each block hash")
            return stored
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(raw["block_hashes"]), _medium(raw.get("medium")), raw.get("group_idx"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError) as exc:
        raise EventFormatError(f"{kind} event without {exc}") from None
    raise EventFormatError(f"unknown event type {kind!r}")


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise EventFormatError(f"expected an integer, got {type(value).__name__}")
    return value


def _hash_or_none(value: Any) -> BlockHash | None:
    if value is None or isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise EventFormatError(f"a block hash is an integer or bytes, got {type(value).__name__}")


def _hashes(values: Any) -> tuple[BlockHash, ...]:
    if not isinstance(values, list):
        raise EventFormatError("block_hashes must be a list")
    hashes = tuple(_hash_or_none(v) for v in values)
    if any(h is None for h in hashes):
        raise EventFormatError("a block hash may not be null")
    return hashes  # type: ignore[return-value]


def _medium(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and 0 < len(value) <= MAX_MEDIUM_CHARS):
        return value
    raise EventFormatError(f"a medium is a name of 1 to {MAX_MEDIUM_CHARS} characters, not {value!r}")


def _str_or_none(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise EventFormatError("lora_name must be a string")


def _extra_keys(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise EventFormatError("extra_keys must be a list")
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def encode_batch(batch: EventBatch) -> bytes:
    """The wire form of `batch`, as vLLM's publisher encodes it (readable by any vLLM-event consumer)."""
    import msgpack

    events = [_encode_event(e) for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def _encode_event(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [list(k) if isinstance(k, tuple) else k for k in event.extra_keys]
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}
