"""Per-tenant rate limiting: GCRA (the generic cell rate algorithm) in one Redis Lua script, fleet-wide and atomic.

GCRA keeps one number per tenant, the theoretical arrival time (TAT) of the next request. With emission interval
T = 1 / rate and a burst of B requests:
    tat = max(stored_tat, now);  new_tat = tat + T
    allowed  iff  new_tat - now <= B * T          (then stored_tat := new_tat)
So from idle a tenant may send B requests at once and then one every T; over any window of W seconds it gets at
most B + floor(W / T) requests. The script reads the clock with Redis TIME, so every control-plane process shares one
clock and one counter; one EVALSHA per request, no read-modify-write race (DRF's cache throttles have one).

The burst is ``rate * settings.KCAAS_RATE_LIMIT_BURST_SECONDS`` (default 1 s of traffic, at least 1).
Without REDIS_URL (the embedded default, one process) the same algorithm runs in process under a lock.
Staff, nodes and anonymous callers are not tenant-limited. If Redis is unreachable the limiter fails open (logged):
an outage of the limiter must not become an outage of the API.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings
from rest_framework.exceptions import Throttled
from rest_framework.throttling import BaseThrottle

from tenants.principals import TenantPrincipal
from tenants.redis_client import get_redis
from tenants.selectors import quota_limits

logger = logging.getLogger("kcaas.tenants.ratelimit")

MICROS = 1_000_000

# KEYS[1] bucket; ARGV[1] emission interval (us); ARGV[2] burst.
# Returns {allowed (0/1), remaining, retry_after_us, reset_us}. Numbers are formatted with %d: Lua 5.1's
# tostring would print a microsecond timestamp in exponent notation and lose precision.
_GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local new_tat = tat + interval
local allow_at = new_tat - burst * interval
if allow_at > now then
  return {0, 0, allow_at - now, tat - now}
end
local ttl_ms = math.floor((new_tat - now) / 1000) + 1
redis.call('SET', KEYS[1], string.format('%d', new_tat), 'PX', string.format('%d', ttl_ms))
return {1, math.floor((now - allow_at) / interval), 0, new_tat - now}
"""


@dataclass(frozen=True, slots=True)
class Decision:
    """One limiter answer. ``remaining``: requests still allowed right now; times in microseconds."""

    allowed: bool
    limit: int
    remaining: int
    retry_after_us: int
    reset_us: int

    @property
    def retry_after_seconds(self) -> int:
        return max(1, math.ceil(self.retry_after_us / MICROS))

    @property
    def reset_seconds(self) -> int:
        return max(0, math.ceil(self.reset_us / MICROS))


def burst_for(rate: float) -> int:
    burst_seconds = float(getattr(settings, "KCAAS_RATE_LIMIT_BURST_SECONDS", 1.0))
    return max(1, int(rate * burst_seconds))


def bucket_key(name: str) -> str:
    return f"kcaas:ratelimit:{name}"


class RedisGcra:
    """GCRA over Redis. ``rate`` may be fractional (tests use slow rates to make counts exact)."""

    def __init__(self, client: redis.Redis):
        self._script = client.register_script(_GCRA_LUA)

    def hit(self, name: str, *, rate: float, burst: int) -> Decision:
        interval = max(1, round(MICROS / rate))
        allowed, remaining, retry_us, reset_us = self._script(keys=[bucket_key(name)], args=[interval, burst])
        return Decision(bool(allowed), burst, int(remaining), int(retry_us), int(reset_us))


class LocalGcra:
    """The same algorithm in process (the embedded default): one lock, a dict of TATs on the monotonic clock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tats: dict[str, int] = {}

    def hit(self, name: str, *, rate: float, burst: int) -> Decision:
        interval = max(1, round(MICROS / rate))
        with self._lock:
            now = time.monotonic_ns() // 1000
            tat = max(self._tats.get(name, 0), now)
            new_tat = tat + interval
            allow_at = new_tat - burst * interval
            if allow_at > now:
                return Decision(False, burst, 0, allow_at - now, tat - now)
            self._tats[name] = new_tat
            if len(self._tats) > 100_000:  # forget idle buckets
                self._tats = {k: v for k, v in self._tats.items() if v > now}
            return Decision(True, burst, (now - allow_at) // interval, 0, new_tat - now)


_local = LocalGcra()
_redis_limiters: dict[int, RedisGcra] = {}


def limiter() -> RedisGcra | LocalGcra:
    client = get_redis()
    if client is None:
        return _local
    found = _redis_limiters.get(id(client))
    if found is None:
        found = _redis_limiters[id(client)] = RedisGcra(client)
    return found


def check_rate(name: str, *, rate: float, burst: int | None = None) -> Decision | None:
    """One hit on the named bucket; None when the limiter is unreachable (fail open, logged)."""
    burst = burst if burst is not None else burst_for(rate)
    try:
        return limiter().hit(name, rate=rate, burst=burst)
    except redis.RedisError:
        logger.warning("rate limiter unavailable; allowing %s", name, exc_info=True)
        return None


class RateLimited(Throttled):
    """429 ``rate_limited``; controlplane.errors copies ``headers`` onto the response and sets Retry-After."""

    def __init__(self, decision: Decision):
        super().__init__(
            wait=decision.retry_after_seconds,
            detail=f"Rate limit exceeded: retry in {decision.retry_after_seconds} s.",
        )
        self.headers = {
            "Retry-After": str(decision.retry_after_seconds),
            "RateLimit-Limit": str(decision.limit),
            "RateLimit-Remaining": "0",
            "RateLimit-Reset": str(max(1, decision.reset_seconds)),
        }


class TenantRateThrottle(BaseThrottle):
    """DRF throttle: each tenant-key request takes one GCRA hit at the tenant's max_requests_per_second.

    Raises RateLimited instead of returning False, so the 429 carries the RateLimit-* headers. The decision of an
    allowed request is left on ``request.ratelimit`` for anything that wants to advertise it.
    """

    def allow_request(self, request, view) -> bool:
        user = getattr(request, "user", None)
        if not isinstance(user, TenantPrincipal):
            return True
        rate = quota_limits(tenant=user.tenant).max_requests_per_second
        decision = check_rate(f"tenant:{user.tenant.pk}", rate=rate)
        if decision is None:
            return True
        if not decision.allowed:
            raise RateLimited(decision)
        request.ratelimit = decision
        return True

    def wait(self):
        return None
