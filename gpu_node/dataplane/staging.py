"""The node's staging memory for puts: one budget for the whole node, buffers shared by every connection.

A put's KV is received into staging and then written into the cache's pool. Staging kept per connection would let a
client pin memory with headers that never send their payload, and let idle connections hold buffers outside any
budget. So:

- `lease(nbytes, tenant)` reserves against the node-wide budget *before* anything is allocated: when leased plus
  idle bytes would pass `max_bytes`, idle buffers are released first, and if that is not enough the request is
  refused with `overloaded` (limit `node_bytes`) — nothing blocks. A request alone always fits (the budget is at
  least one frame).
- A returned lease goes back to the pool (its pages stay warm: a fresh page faults on first touch; bench.engine's
  get_fresh_out shows the cost) and is handed
  out again. Buffers are anonymous mmaps, so releasing one gives its memory back to the operating system.
- Plaintext hygiene: a buffer only ever holds the bytes of the tenant it is tagged with. Handing it to another
  tenant zeroes the bytes the last one wrote first; `scrub_tenant` (erasure) zeroes a purged tenant's idle buffers;
  idle buffers beyond `max_idle_bytes` or idle longer than `idle_seconds` are zeroed and unmapped.

Invariant (`check_invariants`): leased + idle bytes <= max(max_bytes, the largest single lease); every idle buffer
is tagged with the tenant whose bytes it may hold (or None: all zero).
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass, field

from gpu_node.engine.zeroing import zero
from kcaas.wire import ErrorCode, ProtocolError

DEFAULT_RETRY_AFTER_MS = 50
_PAGE = mmap.PAGESIZE


@dataclass(eq=False)
class _Buffer:
    memory: mmap.mmap
    size: int
    tenant: str | None = None  # whose bytes [0, dirty) may hold
    dirty: int = 0
    idle_since: float = field(default_factory=time.monotonic)


class Lease:
    """A staging buffer lent to one request: `view` has exactly the requested bytes. Return it once (idempotent)."""

    __slots__ = ("_pool", "_buffer", "view", "nbytes", "_returned")

    def __init__(self, pool: StagingPool, buffer: _Buffer, nbytes: int):
        self._pool, self._buffer, self.nbytes, self._returned = pool, buffer, nbytes, False
        self.view = memoryview(buffer.memory)[:nbytes]

    def give_back(self) -> None:
        if not self._returned:
            self._returned = True
            self.view = memoryview(b"")  # given back: nothing to read or write through it
            self._pool._give_back(self._buffer, self.nbytes)


class StagingPool:
    def __init__(
        self,
        max_bytes: int,
        *,
        max_idle_bytes: int | None = None,
        idle_seconds: float = 60.0,
        on_refusal=None,
        clock=time.monotonic,
    ):
        self.max_bytes = max_bytes
        self.max_idle_bytes = max_bytes // 2 if max_idle_bytes is None else max_idle_bytes
        self.idle_seconds = idle_seconds
        self._on_refusal = on_refusal
        self._clock = clock
        self._lock = threading.Lock()
        self._idle: list[_Buffer] = []
        self._leased_bytes = 0  # sizes of the buffers lent out
        self._largest = 0

    # ---- lending ----------------------------------------------------------------------------------------------------
    def lease(self, nbytes: int, tenant: str) -> Lease:
        """A buffer of at least `nbytes` for `tenant`'s request, or ProtocolError(overloaded, limit node_bytes)."""
        to_release: list[_Buffer] = []
        with self._lock:
            buffer = self._take_idle(nbytes, tenant)
            if buffer is None:
                size = -(-max(nbytes, 1) // _PAGE) * _PAGE
                to_release = self._make_room(size)
                if self._leased_bytes + self._idle_bytes() + size > self.max_bytes and self._leased_bytes > 0:
                    to_release += self._idle_all()
                    self._refuse()
                buffer = _Buffer(mmap.mmap(-1, size), size)
            self._leased_bytes += buffer.size
            self._largest = max(self._largest, buffer.size)
        for old in to_release:
            _unmap(old)
        if buffer.tenant is not None and buffer.tenant != tenant and buffer.dirty:
            zero(memoryview(buffer.memory)[: buffer.dirty])  # another tenant's bytes: gone before this one's land
            buffer.dirty = 0
        buffer.tenant = tenant
        buffer.dirty = max(buffer.dirty, nbytes)
        return Lease(self, buffer, nbytes)

    def _take_idle(self, nbytes: int, tenant: str) -> _Buffer | None:
        """Under the lock: the smallest idle buffer that fits, the tenant's own first (no zeroing needed)."""
        fitting = [b for b in self._idle if b.size >= nbytes]
        if not fitting:
            return None
        own = [b for b in fitting if b.tenant in (tenant, None)]
        best = min(own or fitting, key=lambda b: b.size)
        self._idle.remove(best)
        return best

    def _make_room(self, size: int) -> list[_Buffer]:
        """Under the lock: idle buffers to release (oldest first) so that a new one of `size` fits the budget."""
        released = []
        self._idle.sort(key=lambda b: b.idle_since)
        while self._idle and self._leased_bytes + self._idle_bytes() + size > self.max_bytes:
            released.append(self._idle.pop(0))
        return released

    def _idle_all(self) -> list[_Buffer]:
        idle, self._idle = self._idle, []
        return idle

    def _idle_bytes(self) -> int:
        return sum(b.size for b in self._idle)

    def _refuse(self):
        if self._on_refusal is not None:
            self._on_refusal("node_bytes")
        raise ProtocolError(
            ErrorCode.OVERLOADED,
            "the node's staging memory is in use: retry shortly",
            details={"limit": "node_bytes", "retry_after_ms": DEFAULT_RETRY_AFTER_MS},
        )

    def _give_back(self, buffer: _Buffer, nbytes: int) -> None:
        now = self._clock()
        buffer.idle_since = now
        with self._lock:
            self._leased_bytes -= buffer.size
            self._idle.append(buffer)
            released = self._trim(now)
        for old in released:
            _unmap(old)

    def _trim(self, now: float) -> list[_Buffer]:
        """Under the lock: idle buffers past idle_seconds, then the oldest beyond max_idle_bytes."""
        released = [b for b in self._idle if now - b.idle_since > self.idle_seconds]
        self._idle = [b for b in self._idle if b not in released]
        self._idle.sort(key=lambda b: b.idle_since)
        while self._idle and self._idle_bytes() > self.max_idle_bytes:
            released.append(self._idle.pop(0))
        return released

    # ---- upkeep -------------------------------------------------------------------------------------------------
    def trim(self) -> int:
        """Release idle buffers past their time (the server calls it now and then); returns how many."""
        with self._lock:
            released = self._trim(self._clock())
        for old in released:
            _unmap(old)
        return len(released)

    def scrub_tenant(self, tenant: str) -> int:
        """Erasure: zero every idle buffer that may hold the tenant's bytes; returns how many."""
        with self._lock:
            mine = [b for b in self._idle if b.tenant == tenant]
        for buffer in mine:
            zero(memoryview(buffer.memory)[: buffer.dirty])
            buffer.tenant, buffer.dirty = None, 0
        return len(mine)

    def close(self) -> None:
        with self._lock:
            idle = self._idle_all()
        for old in idle:
            _unmap(old)

    def usage(self) -> tuple[int, int]:
        """(leased bytes, idle bytes) now."""
        with self._lock:
            return self._leased_bytes, self._idle_bytes()

    def check_invariants(self) -> None:
        with self._lock:
            assert self._leased_bytes >= 0
            assert self._leased_bytes + self._idle_bytes() <= max(self.max_bytes, self._largest)
            for buffer in self._idle:
                assert buffer.tenant is not None or buffer.dirty == 0


def _unmap(buffer: _Buffer) -> None:
    """Zero what a tenant wrote, then drop the buffer: the mapping goes back to the system when the last view of it
    (a frame being answered may still hold one) is gone."""
    zero(memoryview(buffer.memory)[: buffer.dirty])
    buffer.dirty, buffer.tenant = 0, None
