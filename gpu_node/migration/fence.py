"""Write fencing for a cache that is leaving this node: the data plane answers MOVED instead of acknowledging a put
that the migration could miss.

States per cache id: open (absent) -> moving (writes answered MOVED; reads still served here, the bytes no longer
change) -> moved (every request and HELLO answered MOVED: the control plane flipped the placement and the cache is
detached here). `lift()` returns a moving cache to open (a migration that failed before cutover).

Invariant: once `fence()` returns, no write to the cache is in flight and none can start on this node, so the last
copy pass sees every acknowledged put. Writers enter through `writing()` (atomic with the state check).

Why MOVED and not forwarding: forwarding makes the source a proxy for a cache it no longer owns (every put costs
two hops, and a source crash mid-forward leaves the put's fate unknown); MOVED costs the client one reconnect and
the fence window is short (the last delta pass + one control-plane transaction); the SDK waits for the control
plane to issue a token at the new epoch and resends the put, which is idempotent.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from kcaas.wire import ProtocolError

MOVED_CODE = "moved"


class MovedError(ProtocolError):
    """Answer this request with a MOVED frame (endpoint, epoch), not an ERROR."""

    def __init__(self, cache_id: str, endpoint: str, epoch: int):
        super().__init__(MOVED_CODE, f"cache {cache_id} moved to {endpoint} (epoch {epoch})")
        self.cache_id, self.endpoint, self.epoch = cache_id, endpoint, int(epoch)


class FenceTable:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._fenced: dict[str, tuple[str, str, int]] = {}  # cache id -> (state, endpoint, epoch)
        self._writers: dict[str, int] = {}

    def check(self, cache_id: str, *, write: bool) -> None:
        """Raise MovedError when this request must be answered MOVED."""
        with self._cond:
            entry = self._fenced.get(cache_id)
        if entry is not None and (write or entry[0] == "moved"):
            raise MovedError(cache_id, entry[1], entry[2])

    def is_moved(self, cache_id: str) -> tuple[str, int] | None:
        with self._cond:
            entry = self._fenced.get(cache_id)
        return (entry[1], entry[2]) if entry is not None and entry[0] == "moved" else None

    @contextmanager
    def writing(self, cache_id: str):
        """One write to the cache: refused (MovedError) when fenced, else counted until it is done."""
        with self._cond:
            entry = self._fenced.get(cache_id)
            if entry is not None:
                raise MovedError(cache_id, entry[1], entry[2])
            self._writers[cache_id] = self._writers.get(cache_id, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._writers[cache_id] -= 1
                if not self._writers[cache_id]:
                    del self._writers[cache_id]
                self._cond.notify_all()

    def fence(self, cache_id: str, endpoint: str, epoch: int, *, timeout: float = 30.0) -> bool:
        """Refuse new writes (MOVED to endpoint/epoch) and wait for those in flight; False if they did not finish."""
        with self._cond:
            self._fenced[cache_id] = ("moving", endpoint, int(epoch))
            return self._cond.wait_for(lambda: not self._writers.get(cache_id), timeout)

    def moved(self, cache_id: str, endpoint: str, epoch: int) -> None:
        """The placement flipped: every request for the cache is answered MOVED from now on."""
        with self._cond:
            self._fenced[cache_id] = ("moved", endpoint, int(epoch))

    def lift(self, cache_id: str) -> None:
        """A migration that failed before cutover: the cache takes writes here again (a moved cache stays moved)."""
        with self._cond:
            if self._fenced.get(cache_id, ("",))[0] == "moving":
                del self._fenced[cache_id]


_CREATE_LOCK = threading.Lock()


def fences_for(registry) -> FenceTable:
    """The one FenceTable of a node, kept on its CacheRegistry (the data plane and the node tasks share it)."""
    table = getattr(registry, "_migration_fences", None)
    if table is None:
        with _CREATE_LOCK:
            table = getattr(registry, "_migration_fences", None)
            if table is None:
                table = registry._migration_fences = FenceTable()
    return table
