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

import ipaddress
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
    """429 ``rate_limited``; core.errors copies ``headers`` onto the response and sets Retry-After."""

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


# ---- several buckets at once, and giving a hit back (the password doors: controlplane.authentication, console) ----
#
# A password door must refuse *before* it computes a password hash, yet count only failures. So each attempt takes
# one cell from every bucket that concerns it (the account's, the source's) in one atomic step — all or none — and
# an attempt that turns out to succeed gives its cells back. An attacker's concurrent attempts each hold a cell while
# their hash is computed, so concurrency cannot push more hashes through than the limits allow (a "peek, then count
# the failure afterwards" scheme would let every in-flight request past).

# KEYS: the buckets; ARGV: interval_us, burst for each. Allowed only if every bucket allows; then each is advanced.
# Returns {allowed, refused index (1-based; the one with the longest wait, 0 if allowed), remaining (the least over
# the buckets), retry_after_us, reset_us}.
_GCRA_ALL_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local new_tats = {}
local refused, retry, reset, remaining = 0, 0, 0, -1
for i = 1, #KEYS do
  local interval = tonumber(ARGV[2 * i - 1])
  local burst = tonumber(ARGV[2 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local new_tat = tat + interval
  local allow_at = new_tat - burst * interval
  if allow_at > now then
    if allow_at - now > retry then refused, retry, reset = i, allow_at - now, tat - now end
  else
    new_tats[i] = new_tat
    local left = math.floor((now - allow_at) / interval)
    if remaining < 0 or left < remaining then remaining = left end
    if new_tat - now > reset and refused == 0 then reset = new_tat - now end
  end
end
if refused > 0 then return {0, refused, 0, retry, reset} end
for i = 1, #KEYS do
  local ttl_ms = math.floor((new_tats[i] - now) / 1000) + 1
  redis.call('SET', KEYS[i], string.format('%d', new_tats[i]), 'PX', string.format('%d', ttl_ms))
end
return {1, 0, remaining, 0, reset}
"""

# KEYS: the buckets; ARGV: interval_us for each. Moves each TAT back by one interval (never before now).
_GCRA_GIVE_BACK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 1, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  local new_tat = tat - tonumber(ARGV[i])
  if new_tat <= now then
    redis.call('DEL', KEYS[i])
  else
    local ttl_ms = math.floor((new_tat - now) / 1000) + 1
    redis.call('SET', KEYS[i], string.format('%d', new_tat), 'PX', string.format('%d', ttl_ms))
  end
end
return #KEYS
"""


@dataclass(frozen=True, slots=True)
class Bucket:
    """One limit: ``name`` (a bucket_key suffix), ``rate`` cells per second, ``burst`` cells at once."""

    name: str
    rate: float
    burst: int

    @classmethod
    def per_window(cls, name: str, *, count: int, window_seconds: float) -> Bucket:
        """``count`` at once from idle, then one every window/count seconds (over any window: at most 2 x count)."""
        count = max(1, int(count))
        return cls(name, count / float(window_seconds), count)

    @property
    def interval_us(self) -> int:
        return max(1, round(MICROS / self.rate))


@dataclass(frozen=True, slots=True)
class AllDecision:
    """The answer of ``take_all``: ``decision`` as for one bucket; ``refused_by`` the bucket that said no (the one
    with the longest wait), None when allowed."""

    decision: Decision
    refused_by: Bucket | None

    @property
    def allowed(self) -> bool:
        return self.decision.allowed


_redis_all_scripts: dict[int, tuple] = {}


def _redis_scripts(client: redis.Redis):
    found = _redis_all_scripts.get(id(client))
    if found is None:
        found = _redis_all_scripts[id(client)] = (
            client.register_script(_GCRA_ALL_LUA),
            client.register_script(_GCRA_GIVE_BACK_LUA),
        )
    return found


def _local_take_all(buckets) -> AllDecision:
    # The in-process limiter's own lock and TATs: the embedded default's password doors share them with nobody else.
    with _local._lock:
        now = time.monotonic_ns() // 1000
        refused, retry, reset, remaining, new_tats = None, 0, 0, None, {}
        for bucket in buckets:
            tat = max(_local._tats.get(bucket.name, 0), now)
            new_tat = tat + bucket.interval_us
            allow_at = new_tat - bucket.burst * bucket.interval_us
            if allow_at > now:
                if allow_at - now > retry:
                    refused, retry, reset = bucket, allow_at - now, tat - now
            else:
                new_tats[bucket.name] = new_tat
                left = (now - allow_at) // bucket.interval_us
                remaining = left if remaining is None else min(remaining, left)
                if refused is None:
                    reset = max(reset, new_tat - now)
        if refused is not None:
            return AllDecision(Decision(False, refused.burst, 0, retry, reset), refused)
        _local._tats.update(new_tats)
        return AllDecision(Decision(True, min(b.burst for b in buckets), remaining or 0, 0, reset), None)


def _local_give_back(buckets) -> None:
    with _local._lock:
        now = time.monotonic_ns() // 1000
        for bucket in buckets:
            new_tat = _local._tats.get(bucket.name, 0) - bucket.interval_us
            if new_tat <= now:
                _local._tats.pop(bucket.name, None)
            else:
                _local._tats[bucket.name] = new_tat


def take_all(buckets: list[Bucket] | tuple[Bucket, ...]) -> AllDecision | None:
    """One cell from every bucket, atomically, or from none (refused: ``refused_by`` names the bucket). None when the
    limiter is unreachable (fail open, logged, as check_rate)."""
    buckets = tuple(buckets)
    if not buckets:
        raise ValueError("take_all needs at least one bucket")
    client = get_redis()
    try:
        if client is None:
            return _local_take_all(buckets)
        take, _ = _redis_scripts(client)
        args = [value for b in buckets for value in (b.interval_us, b.burst)]
        allowed, refused, remaining, retry_us, reset_us = take(keys=[bucket_key(b.name) for b in buckets], args=args)
    except redis.RedisError:
        logger.warning("rate limiter unavailable; allowing %s", ", ".join(b.name for b in buckets), exc_info=True)
        return None
    refused_by = buckets[int(refused) - 1] if int(refused) else None
    limit = refused_by.burst if refused_by is not None else min(b.burst for b in buckets)
    return AllDecision(Decision(bool(allowed), limit, max(0, int(remaining)), int(retry_us), int(reset_us)), refused_by)


def give_back(buckets: list[Bucket] | tuple[Bucket, ...]) -> None:
    """Return the cell ``take_all`` took from each bucket (an attempt that succeeded is not counted). Never raises:
    an unreachable limiter only means the cells come back with time."""
    buckets = tuple(buckets)
    if not buckets:
        return
    client = get_redis()
    try:
        if client is None:
            _local_give_back(buckets)
            return
        _, back = _redis_scripts(client)
        back(keys=[bucket_key(b.name) for b in buckets], args=[b.interval_us for b in buckets])
    except redis.RedisError:
        logger.warning("rate limiter unavailable; could not give back %s", ", ".join(b.name for b in buckets))


def source_network(address: str | None) -> str:
    """What a per-source limit counts: an IPv4 address, or an IPv6 address's /64 (one subscriber's usual allocation:
    an attacker holding a /64 must not get 2^64 buckets); "unknown" when the address is missing or unparsable."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return "unknown"
    if ip.version == 6:
        if ip.ipv4_mapped is not None:  # ::ffff:192.0.2.1 is 192.0.2.1
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)
