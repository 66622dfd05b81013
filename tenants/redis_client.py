"""The shared Redis connection of the tenants app (rate limits, key usage counters).

``get_redis()`` returns None when settings.REDIS_URL is empty (the embedded default); callers then use their
in-process or database fallback. One client (and connection pool) per URL, so tests that override REDIS_URL work.
"""

from __future__ import annotations

import threading

import redis
from django.conf import settings

_clients: dict[str, redis.Redis] = {}
_lock = threading.Lock()


def get_redis() -> redis.Redis | None:
    url = getattr(settings, "REDIS_URL", "")
    if not url:
        return None
    client = _clients.get(url)
    if client is None:
        with _lock:
            client = _clients.get(url)
            if client is None:
                client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
                _clients[url] = client
    return client
