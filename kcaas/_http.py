"""HTTP helpers of kcaas.Client that need no client state: which requests and answers may be retried, the backoff,
idle-socket liveness, Retry-After and body parsing, key redaction."""

from __future__ import annotations

import json
import random
import select
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

RETRY_STATUSES = frozenset({429, 502, 503, 504})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "DELETE", "PUT", "OPTIONS"})
REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-amzn-requestid", "x-correlation-id")


class ConnectFailed(Exception):
    """Opening the connection failed: nothing was sent, so any request may be retried."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # lower-cased names
    body: Any


def parse_body(raw: bytes) -> Any:
    """JSON when it is JSON, else the start of the text (an HTML error page from a proxy), None when empty."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")[:2000]


def backoff(attempt: int, base: float, cap_max: float) -> float:
    """Full jitter: uniform in [cap/10, cap] with cap = min(cap_max, base * 2**attempt) (attempt 0 first)."""
    cap = min(cap_max, base * (2**attempt))
    return random.uniform(cap / 10, cap)


def redact_key(raw: str) -> str:
    """`kc_live_<public_id>_***`: enough to tell keys apart, nothing secret."""
    parts = raw.split("_")
    if len(parts) >= 4 and raw.startswith("kc_"):
        return "_".join(parts[:3]) + "_***"
    return "***"


def dropped(sock: Any) -> bool:
    """True when an idle keep-alive socket is readable: the peer closed it (or sent junk); either way, do not reuse."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds a Retry-After header (delta-seconds or an HTTP date; lower-cased header names) asks for, at least 0;
    None when absent or unreadable."""
    value = headers.get("retry-after")
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())
