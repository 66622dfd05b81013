"""TokenSource: one data-plane token per (cache, access), shared by threads and refreshed ahead of expiry."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from kcaas.client import Client, DataToken
from kcaas.errors import KcaasError


class TokenSource:
    """Keeps one data token for a cache and refreshes it ahead of expiry. Thread-safe: concurrent callers share one
    token and one refresh. The refresh point is measured on this host's monotonic clock from the token's own
    lifetime (exp - iat), so a skewed local wall clock neither expires tokens early nor uses them late.

    `access` is "read" (lookup and get) unless "readwrite" (also put and delete) is asked for, as for the REST API's
    data tokens: a token grants only what its caller says it needs.

    `get()` -> the current DataToken (refreshed when less than `refresh_fraction` of its life, or less than
    `min_margin_seconds`, is left). `invalidate()` forces the next get() to fetch a new one (call it when the node
    refuses a token: revoked, or the cache moved and the epoch changed).
    """

    def __init__(
        self,
        client: Client,
        cache_id: str,
        access: str = "read",
        *,
        ttl_seconds: int | None = None,
        refresh_fraction: float = 0.2,
        min_margin_seconds: float = 10.0,
    ) -> None:
        self._client = client
        self.cache_id = str(cache_id)
        self.access = access
        self.ttl_seconds = ttl_seconds
        self.refresh_fraction = refresh_fraction
        self.min_margin_seconds = min_margin_seconds
        self._lock = threading.Lock()
        self._token: DataToken | None = None
        self._refresh_at = 0.0  # monotonic
        self._expires_at = 0.0  # monotonic
        self._clock: Callable[[], float] = time.monotonic

    def __repr__(self) -> str:
        return f"TokenSource(cache_id={self.cache_id!r}, access={self.access!r})"

    def get(self) -> DataToken:
        with self._lock:
            if self._token is None or self._clock() >= self._refresh_at:
                try:
                    self._fetch()
                except KcaasError:
                    # a refresh ahead of time that failed: keep serving the old token while it is still valid
                    if self._token is None or self._clock() >= self._expires_at:
                        raise
            assert self._token is not None  # fetched, or the old one still valid
            return self._token

    def invalidate(self) -> None:
        with self._lock:
            self._token = None

    def _fetch(self) -> None:
        started = self._clock()
        token = self._client.issue_token(self.cache_id, access=self.access, ttl_seconds=self.ttl_seconds)
        claims = token.claims()
        try:
            lifetime = float(claims["exp"]) - float(claims["iat"])
        except (KeyError, TypeError, ValueError):
            lifetime = (token.expires_at - datetime.now(UTC)).total_seconds()
        lifetime = max(0.0, lifetime)
        margin = max(lifetime * self.refresh_fraction, min(self.min_margin_seconds, lifetime / 2))
        self._token = token
        self._expires_at = started + lifetime
        self._refresh_at = started + lifetime - margin
