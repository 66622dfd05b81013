"""The fleet's object store as one node process sees it: a narrow client interface and a guard against its faults.

`ObjectStore` is what the network tier (gpu_node/network_tier.py) needs of a distributed KV store: whole immutable
objects by name. `MooncakeObjectStore` is the real one (Mooncake Store over TCP: this process mounts no segment, so
losing it loses no object). `GuardedStore` wraps one and is what the tier holds:

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
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class ObjectStore(Protocol):
    """Whole objects by name in a store shared by the fleet. Names are ASCII; values are bytes-like.

    - `put` stores a whole object or nothing (True when stored, False when the store refused it, e.g. full);
      storing a name that exists keeps one of the two;
    - `get` returns the object's bytes, or None when absent (never a partial object);
    - `exists` answers for each name; `remove` removes what exists and returns how many it removed;
    - `remove_prefix` removes every object whose name starts with the prefix (erasure of a cache).
    Any of them may raise on a store fault (the guard turns that into a miss).
    """

    def put(self, name: str, value) -> bool: ...

    def get(self, name: str) -> bytes | None: ...

    def exists(self, names: list[str]) -> list[bool]: ...

    def remove(self, names: list[str]) -> int: ...

    def remove_prefix(self, prefix: str) -> int: ...

    def close(self) -> None: ...


class StoreFault(RuntimeError):
    """The store answered with an error code (the guard counts it as a fault)."""


class MooncakeObjectStore:
    """ObjectStore on Mooncake Store: `master` "host:port" of the master, `metadata_url` its HTTP metadata server.

    This client mounts no memory segment (global segment size 0): objects live on the store servers only. Its local
    transfer buffer (`buffer_bytes`) bounds one object's size. It connects on first use (and again after a failed
    try): a store that is down when the node starts delays nothing, and one that comes up later is used. A master
    whose port refuses connections fails at once (Mooncake's own setup would retry for ~90 s).
    """

    def __init__(self, master: str, metadata_url: str, *, buffer_bytes: int = 64 << 20, host: str = "127.0.0.1"):
        self._master, self._metadata_url = master, metadata_url
        self._buffer_bytes, self._host = buffer_bytes, host
        self._client = None

    @property
    def _store(self):
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _connect(self):
        from mooncake.store import MooncakeDistributedStore  # only nodes configured with a network store load it

        host, _, port = self._master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
        except OSError as error:
            raise StoreFault(f"the network store's master at {self._master} is not reachable ({error})") from error
        client = MooncakeDistributedStore()
        code = client.setup(self._host, self._metadata_url, 0, self._buffer_bytes, "tcp", "", self._master)
        if code != 0:
            raise StoreFault(f"the network store at {self._master} refused this client (setup answered {code})")
        return client

    def put(self, name: str, value) -> bool:
        """False when the store refused the object (full until its eviction runs, say): an answer, not a fault."""
        code = self._store.put(name, value)
        return code == 0 or self._store.is_exist(name) == 1  # an existing object is a put that changed nothing

    def get(self, name: str) -> bytes | None:
        value = self._store.get(name)
        return value if value else None

    def exists(self, names: list[str]) -> list[bool]:
        answers = self._store.batch_is_exist(list(names))
        if any(answer < 0 for answer in answers):
            raise StoreFault("is_exist answered an error")
        return [answer == 1 for answer in answers]

    def remove(self, names: list[str]) -> int:
        if not names:
            return 0
        return sum(code == 0 for code in self._store.batch_remove(list(names), True))

    def remove_prefix(self, prefix: str) -> int:
        escaped = "".join(c if c.isalnum() else "\\" + c for c in prefix)
        removed = self._store.remove_by_regex("^" + escaped, True)
        if removed < 0:
            raise StoreFault(f"remove_by_regex answered {removed}")
        return removed

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


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

    def close(self) -> None:
        self._calls.put(None)
        self._store.close()

    # ---- the guard ---------------------------------------------------------------------------------------------------
    def _call(self, method: Callable, args: tuple, miss: Any) -> Any:
        if not self.healthy:
            with self._lock:
                self.num_skipped += 1
            return miss
        deadline = self._clock() + self.timeout_s
        if not self._worker_free.acquire(timeout=self.timeout_s):  # the worker is still stuck on an abandoned call
            return self._fault("the store's worker is still busy with a call past its deadline", miss)
        done = threading.Event()
        outcome: dict[str, Any] = {}
        self._calls.put((method, args, outcome, done))
        if not done.wait(max(0.0, deadline - self._clock())):
            return self._fault(f"no answer within {self.timeout_s} s", miss)
        if "error" in outcome:
            return self._fault(repr(outcome["error"]), miss)
        self._closed()
        return outcome["value"]

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            method, args, outcome, done = call
            try:
                outcome["value"] = method(*args)
            except Exception as error:  # a store fault of any kind is the guard's to count, never the caller's
                outcome["error"] = error
            finally:
                done.set()
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
