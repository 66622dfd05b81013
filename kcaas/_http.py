"""HTTP helpers of kcaas.Client that need no client state: idle-socket liveness and Retry-After parsing."""

from __future__ import annotations

import select
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, Mapping


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
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
