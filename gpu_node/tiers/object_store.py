"""The fleet's object store as one node process sees it: a narrow client interface and its Mooncake client.

`ObjectStore` is what the network tier (gpu_node/tiers/network_tier.py) needs of a distributed KV store: whole immutable
objects by name. `MooncakeObjectStore` is the real one (Mooncake Store over TCP: this process mounts no segment, so
losing it loses no object). The tier holds one wrapped in gpu_node/tiers/guarded_store.py's `GuardedStore`, which
makes its faults misses and gives its calls a deadline.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from gpu_node.errors import NodeError

log = logging.getLogger(__name__)


class ObjectStore(Protocol):
    """Whole objects by name in a store shared by the fleet. Names are ASCII; values are bytes-like.

    - `put` stores a whole object or nothing (True when stored, False when the store refused it, e.g. full);
      storing a name that exists keeps one of the two;
    - `get` returns the object's bytes, or None when absent (never a partial object);
    - `exists` answers for each name; `remove` removes what exists and returns how many it removed;
    - `remove_prefix` removes every object whose name starts with the prefix (erasure of a cache);
    - `read(name, consume)` / `read_many(names, consume, slot_bytes)` hand each object's name and bytes to
      `consume(name, view)` (the view is valid only during the call: the store's reused buffer) and return what it
      returns (None when absent);
      `write(name, nbytes, fill)` lets `fill` write the object into the store's reused buffer, then stores it, and
      `write_many(names, sizes, fill)` does so for several (`fill(i, view)`) in one batched transfer. These are the
      zero-copy paths: no Python bytes object per object.
    Any of them may raise on a store fault (the guard turns that into a miss).
    """

    def put(self, name: str, value) -> bool: ...

    def get(self, name: str) -> bytes | None: ...

    def exists(self, names: list[str]) -> list[bool]: ...

    def remove(self, names: list[str]) -> int: ...

    def remove_prefix(self, prefix: str) -> int: ...

    def read(self, name: str, consume: Callable[[str, memoryview], Any]) -> Any: ...

    def read_many(self, names: list[str], consume: Callable[[str, memoryview], Any], slot_bytes: int) -> list: ...

    def write(self, name: str, nbytes: int, fill: Callable[[memoryview], Any]) -> bool: ...

    def write_many(self, names: list[str], sizes: list[int], fill: Callable[[int, memoryview], Any]) -> list[bool]: ...

    def close(self) -> None: ...


class StoreFault(NodeError, RuntimeError):
    """The store answered with an error code (the guard counts it as a fault)."""


class MooncakeObjectStore:
    """ObjectStore on Mooncake Store: `master` "host:port" of the master, `metadata_url` its HTTP metadata server.

    This client mounts no memory segment (global segment size 0): objects live on the store servers only. Its local
    transfer buffer (`buffer_bytes`) bounds one object's size. It connects on first use (and again after a failed
    try): a store that is down when the node starts delays nothing, and one that comes up later is used. A master
    whose port refuses connections fails at once (Mooncake's own setup would retry for ~90 s).

    Zero-copy transfers use buffers registered with the client on first use and reused, each at least a chunk of 2 MiB
    records (TRANSFER_BUFFER_BYTES: a batch's size never regrows one): two per direction, so a batched call is a
    pipeline of chunks of `chunk_blocks` (`write_many` seals chunk k+1 while chunk k is sent, `read_many` opens chunk
    k while chunk k+1 arrives, the other chunk's transfer on the transfer thread; the first read and the last write
    run on the calling thread), and one each for single reads and writes. A buffer is written again only once the
    transfer that used it answered; larger objects grow it (doubling).
    """

    def __init__(
        self,
        master: str,
        metadata_url: str,
        *,
        buffer_bytes: int = 64 << 20,
        host: str = "127.0.0.1",
        chunk_blocks: int | None = None,
    ):
        self._master, self._metadata_url = master, metadata_url
        self._buffer_bytes, self._host = buffer_bytes, host
        self.chunk_blocks = chunk_blocks or default_chunk_blocks()  # objects per pipelined transfer
        self._client = None
        self._buffers: dict[str, _Registered] = {}  # by purpose: reused, registered with the client
        self._transfers: ThreadPoolExecutor | None = None  # the pipelines' transfer thread, started on first use
        self.num_buffer_registrations = 0  # transfer buffers registered: one per purpose, unless objects outgrow it

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

    def read(self, name: str, consume: Callable[[str, memoryview], Any]) -> Any:
        buffer = self._buffer("read", 4 << 20)
        size = self._store.get_into(name, buffer.address, buffer.size)
        if size == TOO_SMALL:
            needed = self._store.get_size(name)
            if needed <= 0:
                return None
            buffer = self._buffer("read", needed)
            size = self._store.get_into(name, buffer.address, buffer.size)
        return consume(name, buffer.view[:size]) if size > 0 else None

    def read_many(self, names: list[str], consume: Callable[[str, memoryview], Any], slot_bytes: int) -> list:
        """Batched transfers of up to `chunk_blocks` objects, pipelined: chunk k+1 is transferred (on the
        client's transfer thread, which holds no GIL while the store moves bytes) into one buffer while the objects
        of chunk k are consumed from the other; the first chunk is transferred on this thread (no hand-off before
        there is work to overlap). An object larger than its slot is read alone."""
        slot = max(int(slot_bytes), 4096)
        chunks = _chunks(names, self.chunk_blocks)
        sides = min(2, len(chunks))  # a second buffer only when a transfer overlaps the opening of another
        buffers = [self._buffer(f"batch{side}", slot * self.chunk_blocks) for side in range(sides)]  # a whole chunk
        results: list = []
        sizes = self._store.batch_get_into(*self._slots(chunks[0], buffers[0], slot))
        transfer: Future | None = None
        try:
            for k, chunk in enumerate(chunks):
                if transfer is not None:
                    sizes, transfer = transfer.result(), None
                if k + 1 < len(chunks):
                    slots = self._slots(chunks[k + 1], buffers[(k + 1) % sides], slot)
                    transfer = self._start(self._store.batch_get_into, *slots)
                results.extend(self._consume_chunk(chunk, sizes, buffers[k % sides].view, slot, consume))
        finally:
            _settle(transfer)  # a consumer that raised: the buffer is not handed out again while it is written
        return results

    def _consume_chunk(self, chunk: list[str], sizes: list[int], view: memoryview, slot: int, consume) -> list:
        results = []
        for i, (name, size) in enumerate(zip(chunk, sizes)):
            if size == TOO_SMALL:
                results.append(self.read(name, consume))
            else:
                results.append(consume(name, view[i * slot : i * slot + size]) if size > 0 else None)
        return results

    @staticmethod
    def _slots(names: list[str], buffer: _Registered, slot: int) -> tuple[list[str], list[int], list[int]]:
        """batch_get_into's arguments for `names` into `buffer`'s slots of `slot` bytes."""
        return names, [buffer.address + i * slot for i in range(len(names))], [slot] * len(names)

    def _start(self, method: Callable, *args) -> Future:
        """`method(*args)` on the transfer thread, returned once that thread runs it: the caller's next work (sealing,
        opening: GIL-bound) then overlaps the transfer instead of keeping its thread from starting."""
        if self._transfers is None:
            self._transfers = ThreadPoolExecutor(1, thread_name_prefix="kcaas-store-transfer")
        started = threading.Event()

        def run():
            started.set()
            return method(*args)

        future = self._transfers.submit(run)
        started.wait()
        return future

    def write(self, name: str, nbytes: int, fill: Callable[[memoryview], Any]) -> bool:
        buffer = self._buffer("write", nbytes)
        fill(buffer.view[:nbytes])
        code = self._store.put_from(name, buffer.address, nbytes)
        return code == 0 or self._store.is_exist(name) == 1

    def write_many(self, names: list[str], sizes: list[int], fill: Callable[[int, memoryview], Any]) -> list[bool]:
        """Batched puts of up to `chunk_blocks` objects, pipelined: chunk k+1 is filled (sealed) into one
        buffer while chunk k is sent from the other on the transfer thread; the last chunk is sent from this thread.
        A buffer is filled again only once the transfer that read it answered."""
        chunks = _chunks(list(range(len(names))), self.chunk_blocks)
        sides, most = min(2, len(chunks)), max(sizes, default=0)  # a buffer holds a whole chunk of the largest
        codes: list[int] = []
        transfer: Future | None = None
        try:
            for k, chunk in enumerate(chunks):
                buffer = self._buffer(f"send{k % sides}", max(sum(sizes[i] for i in chunk), most * self.chunk_blocks))
                offsets = [0, *itertools.accumulate(sizes[i] for i in chunk[:-1])]
                for i, offset in zip(chunk, offsets):
                    fill(i, buffer.view[offset : offset + sizes[i]])
                if transfer is not None:
                    codes.extend(transfer.result())
                    transfer = None
                args = ([names[i] for i in chunk], [buffer.address + at for at in offsets], [sizes[i] for i in chunk])
                if k + 1 < len(chunks):
                    transfer = self._start(self._store.batch_put_from, *args)
                else:
                    codes.extend(self._store.batch_put_from(*args))
        finally:
            _settle(transfer)
        return [code == 0 or self._store.is_exist(name) == 1 for name, code in zip(names, codes)]

    def _buffer(self, purpose: str, nbytes: int) -> _Registered:
        """This client's reused buffer for `purpose`, registered with the transfer engine, at least `nbytes`."""
        current = self._buffers.get(purpose)
        if current is not None and current.size >= nbytes:
            return current
        if current is not None:
            self._buffers.pop(purpose)
            self._store.unregister_buffer(current.address)
        fresh = _Registered(max(nbytes, TRANSFER_BUFFER_BYTES, 2 * current.size if current is not None else 0))
        if self._store.register_buffer(fresh.address, fresh.size) != 0:
            raise StoreFault("the store client refused to register a transfer buffer")
        self.num_buffer_registrations += 1
        self._buffers[purpose] = fresh
        return fresh

    def close(self) -> None:
        """Close the client; its buffers are unregistered first (the transfer engine outlives a client in this
        process, and a later client's buffer at a freed address must not meet a stale registration)."""
        if self._transfers is not None:
            self._transfers.shutdown(wait=True)
        if self._client is not None:
            for buffer in self._buffers.values():
                self._client.unregister_buffer(buffer.address)
            self._buffers.clear()
            self._client.close()


TOO_SMALL = -600  # Mooncake's answer to a get_into whose buffer cannot hold the object
PIPELINE_CHUNK_BLOCKS = 4  # objects per transfer where chunks overlap: sealing / opening one hides under another's
WHOLE_BATCH_BLOCKS = 16  # where they cannot: a tier's whole batch (network_tier.WRITE_BATCH_BLOCKS) per transfer
TRANSFER_BUFFER_BYTES = 12 << 20  # a transfer buffer's least size: a chunk of 2 MiB records (larger grow it)


def default_chunk_blocks() -> int:
    """PIPELINE_CHUNK_BLOCKS where this process may run on more than 2 cores, else WHOLE_BATCH_BLOCKS. Overlap needs
    a core besides the transfer's: the Mooncake client polls for a transfer's completion on one, and a store server
    on the same host copies on another; on 2 cores, sealing or opening beside a transfer only slows it, and smaller
    transfers cost more each (bench.tiers: `network_put_stages` and docs/performance.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return PIPELINE_CHUNK_BLOCKS if cores > 2 else WHOLE_BATCH_BLOCKS


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _settle(transfer: Future | None) -> None:
    """Wait for a transfer whose caller is leaving on an error (its fault is the caller's, already raised)."""
    if transfer is not None:
        try:
            transfer.result()
        except Exception:  # noqa: BLE001 - the error that made the caller leave is the one it reports
            pass


class _Registered:
    """A reused host buffer and its address, for the store client's zero-copy transfers."""

    def __init__(self, size: int):
        self.size = size
        self.data = bytearray(size)
        self.view = memoryview(self.data)
        self.address = ctypes.addressof((ctypes.c_char * size).from_buffer(self.data))
