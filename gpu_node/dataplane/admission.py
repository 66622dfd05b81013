"""Per-tenant admission on a node's data plane: one tenant cannot take the node's connections, request slots or
staging memory from the others.

Three limits per tenant (the `sub` claim of its data token, `tenant:<id>`):
- connections holding at least one authenticated session of the tenant (checked at HELLO);
- requests executing at once (one per connection at most; checked when a request's metadata has been read, before
  any payload byte is taken);
- bytes staged for those requests (a put's KV when its metadata arrives; a get's KV when its size is known).

A request over a limit is refused with `overloaded` (details: `limit`, `retry_after_ms`) and loses nothing: a
refused put's payload is discarded unread into the cache, and the client retries after the hint. Nothing here
blocks: waiting would let one tenant's queue hold a connection thread that another tenant's request could use.

Invariant (checked by `check_invariants`): for every tenant, the counters equal the sum of the live holds and
connection claims, and none is negative; an entry whose counters are all zero is removed (no growth per tenant
id ever seen).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kcaas.wire import ErrorCode, ProtocolError

DEFAULT_RETRY_AFTER_MS = 50


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_connections: int = 64
    max_inflight_requests: int = 8
    max_inflight_bytes: int = 1 << 30


@dataclass(slots=True)
class _Usage:
    connections: int = 0
    requests: int = 0
    bytes: int = 0

    def idle(self) -> bool:
        return self.connections == 0 and self.requests == 0 and self.bytes == 0


class Hold:
    """One admitted request: its slot and the bytes it stages. `grow` adds bytes (or refuses); `release` is
    idempotent and gives everything back."""

    __slots__ = ("_admission", "tenant", "nbytes", "_released")

    def __init__(self, admission: TenantAdmission, tenant: str, nbytes: int):
        self._admission, self.tenant, self.nbytes, self._released = admission, tenant, nbytes, False

    def grow(self, nbytes: int) -> None:
        if nbytes > 0:
            self._admission._grow(self, nbytes)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self)


class TenantAdmission:
    def __init__(self, limits: TenantLimits | None = None, *, on_refusal=None):
        """`on_refusal(limit_name)` (optional) counts refusals, e.g. a Prometheus counter labelled by limit."""
        self.limits = limits or TenantLimits()
        self._on_refusal = on_refusal
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}

    # ---- connections ----------------------------------------------------------------------------------------------
    def connect(self, tenant: str) -> None:
        """Count one more connection of `tenant`, or raise overloaded."""
        with self._lock:
            usage = self._usage.setdefault(tenant, _Usage())
            if usage.connections >= self.limits.max_connections:
                self._drop_if_idle(tenant, usage)
                self._refuse("connections", "too many data-plane connections for this tenant on this node")
            usage.connections += 1

    def disconnect(self, tenant: str) -> None:
        with self._lock:
            usage = self._usage[tenant]
            assert usage.connections > 0, "disconnect without connect"
            usage.connections -= 1
            self._drop_if_idle(tenant, usage)

    # ---- requests -------------------------------------------------------------------------------------------------
    def admit(self, tenant: str, nbytes: int = 0) -> Hold:
        """A slot for one request staging `nbytes`, or overloaded."""
        with self._lock:
            usage = self._usage.setdefault(tenant, _Usage())
            if usage.requests >= self.limits.max_inflight_requests:
                self._drop_if_idle(tenant, usage)
                self._refuse("requests", "too many requests in flight for this tenant on this node")
            self._check_bytes(tenant, usage, nbytes, others=usage.requests)
            usage.requests += 1
            usage.bytes += nbytes
        return Hold(self, tenant, nbytes)

    def _grow(self, hold: Hold, nbytes: int) -> None:
        with self._lock:
            usage = self._usage[hold.tenant]
            self._check_bytes(hold.tenant, usage, nbytes, others=usage.requests - 1)
            usage.bytes += nbytes
            hold.nbytes += nbytes

    def _release(self, hold: Hold) -> None:
        with self._lock:
            usage = self._usage[hold.tenant]
            usage.requests -= 1
            usage.bytes -= hold.nbytes
            assert usage.requests >= 0 and usage.bytes >= 0, "released more than admitted"
            self._drop_if_idle(hold.tenant, usage)

    # ---- helpers ----------------------------------------------------------------------------------------------------
    def _check_bytes(self, tenant: str, usage: _Usage, nbytes: int, *, others: int) -> None:
        if usage.bytes + nbytes > self.limits.max_inflight_bytes and others > 0:
            # a request alone is always admitted (the frame limit bounds it): a budget smaller than one frame
            # must slow a tenant down, never lock it out
            self._drop_if_idle(tenant, usage)
            self._refuse("bytes", "too many bytes in flight for this tenant on this node")

    def _drop_if_idle(self, tenant: str, usage: _Usage) -> None:
        if usage.idle():
            self._usage.pop(tenant, None)

    def _refuse(self, limit: str, message: str):
        if self._on_refusal is not None:
            self._on_refusal(limit)
        raise ProtocolError(
            ErrorCode.OVERLOADED, message, details={"limit": limit, "retry_after_ms": DEFAULT_RETRY_AFTER_MS}
        )

    def usage(self, tenant: str) -> tuple[int, int, int]:
        """(connections, requests, bytes) of `tenant` now."""
        with self._lock:
            usage = self._usage.get(tenant, _Usage())
            return usage.connections, usage.requests, usage.bytes

    def check_invariants(self) -> None:
        with self._lock:
            for tenant, usage in self._usage.items():
                assert min(usage.connections, usage.requests, usage.bytes) >= 0, tenant
                assert not usage.idle(), f"idle entry kept for {tenant}"


# ---- before authentication --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NodeLimits:
    """Node-wide limits that hold before any tenant is known, and the node's staging budget."""

    max_connections_per_source: int = 64  # every connection from one address (a Unix socket: one peer uid)
    max_unauthenticated: int = 64  # connections that have not yet opened a session, node-wide
    max_unauthenticated_per_source: int = 8
    hello_timeout: float = 5.0  # seconds from accept (TLS handshake included) to the first good HELLO
    payload_stall_timeout: float = 10.0  # inside a frame, seconds without a byte: the connection is cut
    max_staged_bytes: int = 4 << 30  # every put's staging together (gpu_node/dataplane/staging.py), node-wide


class ConnectionGate:
    """Who may connect before authenticating. At accept: a source under its connection limit, and both the node
    and the source under their limits of unauthenticated connections, or the socket is closed before a handshake
    is spent on it. A connection stops counting as unauthenticated at its first successful HELLO.

    Invariant: counters equal the live connections they count, never negative; a source with none is dropped.
    """

    def __init__(self, limits: NodeLimits, *, on_refusal=None):
        self.limits = limits
        self._on_refusal = on_refusal
        self._lock = threading.Lock()
        self._by_source: dict[str, int] = {}
        self._unauthenticated: dict[str, int] = {}

    def admit(self, source: str) -> bool:
        limits = self.limits
        with self._lock:
            refused = None
            if self._by_source.get(source, 0) >= limits.max_connections_per_source:
                refused = "source"
            elif sum(self._unauthenticated.values()) >= limits.max_unauthenticated:
                refused = "unauthenticated"
            elif self._unauthenticated.get(source, 0) >= limits.max_unauthenticated_per_source:
                refused = "unauthenticated_source"
            if refused is None:
                self._by_source[source] = self._by_source.get(source, 0) + 1
                self._unauthenticated[source] = self._unauthenticated.get(source, 0) + 1
        if refused is not None and self._on_refusal is not None:
            self._on_refusal(refused)
        return refused is None

    def authenticated(self, source: str) -> None:
        with self._lock:
            self._decrement(self._unauthenticated, source)

    def closed(self, source: str, *, authenticated: bool) -> None:
        with self._lock:
            self._decrement(self._by_source, source)
            if not authenticated:
                self._decrement(self._unauthenticated, source)

    @staticmethod
    def _decrement(counts: dict[str, int], source: str) -> None:
        left = counts[source] - 1
        assert left >= 0, "a connection counted out twice"
        if left:
            counts[source] = left
        else:
            del counts[source]

    def counts(self, source: str) -> tuple[int, int]:
        """(connections, unauthenticated connections) of `source` now."""
        with self._lock:
            return self._by_source.get(source, 0), self._unauthenticated.get(source, 0)
