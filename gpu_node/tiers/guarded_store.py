"""A guard against the object store's faults: `GuardedStore` wraps an ObjectStore (gpu_node/tiers/object_store.py) and
is what the network tier holds.

- every call runs on the guard's own worker thread and is waited on with a deadline (`timeout_s`): a stopped master
  otherwise blocks a Mooncake call for ~30 s;
- a timeout or an error opens a breaker for a back-off (`min_backoff_s`, doubling to `max_backoff_s` while faults go
  on): while open, calls answer at once as a miss (None / False / 0) and count as skipped; the first call after the
  back-off is a trial, and a success closes the breaker;
- a call still stuck on the worker when its deadline passed is abandoned (the worker stays busy until the store
  answers it); further calls wait for the worker no longer than their own deadline, so nothing waits longer than
  `timeout_s` however the store behaves.

Invariants: a guarded call never raises (store faults are misses) and never blocks longer than `timeout_s` (plus the
time to hand the call to the worker); `healthy` is False exactly while the breaker is open.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_node.tiers.object_store import ObjectStore

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # how long close waits for a running call before leaving the client open


class _Call:
    """One call handed to the guard's worker. Exactly one of these happens: the caller takes the value (it answered
    in time), or the caller gave up first and the value, when it comes, goes to `abandon`."""

    def __init__(
        self,
        method: Callable,
        args: tuple,
        abandon: Callable[[Any], None] | None,
        cleanup: Callable[[], None] | None = None,
    ):
        self.method, self.args, self.abandon, self.cleanup = method, args, abandon, cleanup
        self.value: Any = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False

    def run(self) -> None:
        try:
            value = self.method(*self.args)
        except Exception as error:  # noqa: BLE001 - a store fault of any kind is the guard's to count, not the caller's
            value, self.error = None, error
        finally:
            if self.cleanup is not None:
                self.cleanup()
        with self._lock:
            if self._abandoned:
                if value is not None and self.abandon is not None:
                    self.abandon(value)
                return
            self.value = value
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """True when the call answered in time; else it is abandoned (its value, if it comes, is let go)."""
        if self._done.wait(timeout):
            return True
        with self._lock:
            if self._done.is_set():
                return True
            self._abandoned = True
            return False


class GuardedStore:
    """An ObjectStore whose faults are misses and whose calls have a deadline (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        timeout_s: float = 1.0,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self.timeout_s = timeout_s
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff_s = 0.0
        self._open_until = 0.0
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._worker_free = threading.Semaphore(1)
        self.num_faults = 0  # timeouts and errors
        self.num_skipped = 0  # calls answered as a miss while the breaker was open
        self._closing = False  # set once by close: every later call is a miss, never a call into a closed client
        self._worker = threading.Thread(target=self._serve, name="kcaas-object-store", daemon=True)
        self._worker.start()

    @property
    def healthy(self) -> bool:
        with self._lock:
            return self._clock() >= self._open_until

    def put(self, name: str, value) -> bool:
        return bool(self._call(self._store.put, (name, value), False))

    def get(self, name: str) -> bytes | None:
        return self._call(self._store.get, (name,), None)

    def exists(self, names: list[str]) -> list[bool]:
        if not names:
            return []
        answers = self._call(self._store.exists, (names,), None)
        return list(answers) if answers is not None else [False] * len(names)

    def remove(self, names: list[str]) -> int:
        return int(self._call(self._store.remove, (list(names),), 0)) if names else 0

    def remove_prefix(self, prefix: str) -> int:
        return int(self._call(self._store.remove_prefix, (prefix,), 0))

    def read(
        self, name: str, consume: Callable[[str, memoryview], Any], abandon: Callable[[Any], None] | None = None
    ) -> Any:
        """`consume` runs on the guard's thread, within the call's deadline (the buffer is valid only then);
        `abandon(result)` gets a result that came after the deadline."""
        return self._call(self._store.read, (name, consume), None, abandon)

    def read_many(
        self,
        names: list[str],
        consume: Callable[[str, memoryview], Any],
        slot_bytes: int,
        abandon: Callable[[Any], None] | None = None,
    ) -> list:
        if not names:
            return []

        def abandon_all(results: list) -> None:
            for result in results:
                if result is not None and abandon is not None:
                    abandon(result)

        results = self._call(self._store.read_many, (list(names), consume, slot_bytes), None, abandon_all)
        return list(results) if results is not None else [None] * len(names)

    def write(self, name: str, nbytes: int, fill: Callable[[memoryview], Any]) -> bool:
        return bool(self._call(self._store.write, (name, nbytes, fill), False))

    def write_many(
        self,
        names: list[str],
        sizes: list[int],
        fill: Callable[[int, memoryview], Any],
        cleanup: Callable[[], None] | None = None,
    ) -> list[bool]:
        """`cleanup()` runs once `fill` can no longer be called (after the transfer, on the worker; or here, when
        the call never reached it): where the caller lets go of what `fill` reads, even past the deadline."""
        if not names:
            if cleanup is not None:
                cleanup()
            return []
        stored = self._call(self._store.write_many, (list(names), list(sizes), fill), None, cleanup=cleanup)
        return list(stored) if stored is not None else [False] * len(names)

    def close(self) -> None:
        """Stop taking calls (later ones are misses), let the worker finish what it runs, then close the client. A
        call stuck in the store past CLOSE_WAIT_S keeps the client open (closing a Mooncake client under a running
        call crashes the process): it is left to the process's exit."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._calls.put(None)
        self._worker.join(timeout=max(CLOSE_WAIT_S, 2 * self.timeout_s))
        if self._worker.is_alive():
            log.warning("a network store call is still running: its client is left open")
            return
        self._store.close()

    # ---- the guard ---------------------------------------------------------------------------------------------------
    def _call(
        self,
        method: Callable,
        args: tuple,
        miss: Any,
        abandon: Callable[[Any], None] | None = None,
        cleanup: Callable[[], None] | None = None,
    ) -> Any:
        """Run `method(*args)` on the worker, waiting until the deadline; `abandon(value)` gets the value of a call
        that answered after its caller gave up (to zero what it decrypted); `cleanup()` runs exactly once after the
        method ran (on the worker) or instead of it (here, when the call never reached the worker)."""
        if self._closing or not self.healthy:
            with self._lock:
                self.num_skipped += 1
            if cleanup is not None:
                cleanup()
            return miss
        deadline = self._clock() + self.timeout_s
        if not self._worker_free.acquire(timeout=self.timeout_s):  # the worker is still stuck on an abandoned call
            if cleanup is not None:
                cleanup()
            return self._fault("the store's worker is still busy with a call past its deadline", miss)
        call = _Call(method, args, abandon, cleanup)
        with self._lock:  # queued before close's sentinel, or not at all
            closing = self._closing
            if not closing:
                self._calls.put(call)
        if closing:
            self._worker_free.release()
            if cleanup is not None:
                cleanup()
            return miss
        if not call.wait(max(0.0, deadline - self._clock())):
            return self._fault(f"no answer within {self.timeout_s} s", miss)
        if call.error is not None:
            return self._fault(repr(call.error), miss)
        self._closed()
        return call.value

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            try:
                call.run()
            finally:
                self._worker_free.release()

    def _fault(self, reason: str, miss: Any) -> Any:
        with self._lock:
            self.num_faults += 1
            self._backoff_s = min(self._max_backoff_s, max(self._min_backoff_s, 2 * self._backoff_s))
            self._open_until = self._clock() + self._backoff_s
            backoff = self._backoff_s
        log.warning("network store fault (%s): its tier answers misses for %.1f s", reason, backoff)
        return miss

    def _closed(self) -> None:
        with self._lock:
            self._backoff_s = 0.0
