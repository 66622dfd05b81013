"""The tier's transfer thread (no vLLM import): store and load jobs run here, one at a time, off the scheduler.

    jobs = TransferThread(store)                 # store: a ChunkStore of its own (its own connection)
    jobs.submit(Job(job_id, keys, slots, load))  # returns at once
    jobs.finished()                              # -> [Finished(job_id, keys, whole, seconds, nbytes)], drained
    jobs.drain()                                 # blocks until every submitted job has finished
    jobs.close()                                 # finishes queued jobs as failures, stops the thread

A job never raises out of the thread and never hangs past the store's I/O timeout per round trip: a node that fails
or is down finishes the job with fewer whole chunks (a load) or none (a store), which the tier reports as a failure
and vLLM recomputes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kcaas.connectors.vllm_tier_io import TRANSFER_ERRORS, ChunkStore

__all__ = ["Finished", "Job", "TransferThread"]


@dataclass(frozen=True, slots=True)
class Job:
    job_id: int
    keys: Sequence[bytes]
    slots: Sequence[int]  # primary-tier chunk slots, one per key
    is_load: bool


@dataclass(frozen=True, slots=True)
class Finished:
    job_id: int
    keys: Sequence[bytes]
    whole: int  # leading keys that completed (len(keys): the job succeeded)
    seconds: float
    nbytes: int

    @property
    def success(self) -> bool:
        return self.whole == len(self.keys)


class TransferThread:
    """One worker thread over one ChunkStore; results are collected by `finished()` on the caller's thread."""

    def __init__(self, store: ChunkStore, name: str = "kcaas-tier-io"):
        self._store = store
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (non-blocking); after close() it finishes at once as a failure."""
        with self._idle:
            if self._closed:
                self._done.put(Finished(job.job_id, job.keys, 0, 0.0, 0))
                return
            self._in_flight += 1
        self._queue.put(job)

    def finished(self) -> list[Finished]:
        """Every job finished since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def drain(self) -> None:
        """Block until no job is queued or running (each ends within its round trips' I/O timeouts)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def close(self) -> None:
        """Stop after the running job; queued jobs finish as failures."""
        with self._idle:
            self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._store.close()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            result = Finished(job.job_id, job.keys, 0, 0.0, 0)
            try:
                if not self._closed:
                    result = self._run_one(job)
            except Exception:  # noqa: BLE001 - an unforeseen error fails the job; a dead thread would hang vLLM
                pass
            self._finish(result)
        while True:  # jobs queued behind the stop: failures, so drain() and the tier's bookkeeping end
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._finish(Finished(job.job_id, job.keys, 0, 0.0, 0))

    def _run_one(self, job: Job) -> Finished:
        start = time.monotonic()
        if job.is_load:
            whole = self._store.load(job.keys, job.slots)
        else:
            try:
                whole = len(job.keys) if self._store.store(job.keys, job.slots) else 0
            except TRANSFER_ERRORS:
                whole = 0
        nbytes = whole * self._store.geometry.payload_bytes
        return Finished(job.job_id, job.keys, whole, time.monotonic() - start, nbytes)

    def _finish(self, result: Finished) -> None:
        self._done.put(result)
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()
