"""The wire's metadata field checks, shared by the request/response codecs (kcaas/wire/messages.py) and the EVENTS
exchange (kcaas/wire/events.py): each refusal is a ProtocolError with a machine-readable code."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

from kcaas.wire.frames import ErrorCode, ProtocolError


def _bad(code: str, message: str, request_id: int | None = None, **details: Any) -> ProtocolError:
    return ProtocolError(code, message, request_id=request_id, details=details or None)


def _str_field(meta: dict, key: str, request_id: int | None, *, max_len: int = 256) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise _bad(ErrorCode.BAD_REQUEST, f"{key} must be a non-empty string of at most {max_len} chars", request_id)
    return value


def _int_field(meta: dict, key: str, request_id: int | None, *, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(ErrorCode.BAD_REQUEST, f"{key} must be an integer in [{lo}, {hi}]", request_id)
    return value


def _int_list(
    meta: dict,
    key: str,
    n: int,
    request_id: int | None,
    *,
    lo: int = 0,
    hi: int = (1 << 63) - 1,
    code: str = ErrorCode.BAD_REQUEST,
) -> tuple[int, ...]:
    value = meta.get(key)
    if type(value) is list and len(value) == n:  # JSON gives exact types: int here is never a bool
        for v in value:
            if type(v) is not int or not lo <= v <= hi:
                break
        else:
            return tuple(value)
    raise _bad(code, f"{key} must be a list of {n} integers in [{lo}, {hi}]", request_id)


def _bool_list(meta: dict, key: str, n: int, request_id: int | None) -> tuple[bool, ...]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) != n or any(not isinstance(v, bool) for v in value):
        raise _bad(ErrorCode.BAD_REQUEST, f"{key} must be a list of {n} booleans", request_id)
    return tuple(value)


def _check_keys(meta: dict, allowed: AbstractSet[str], request_id: int | None) -> None:
    unknown = set(meta) - allowed
    if unknown:
        raise _bad(ErrorCode.BAD_REQUEST, f"unknown metadata fields {sorted(unknown)}", request_id)
