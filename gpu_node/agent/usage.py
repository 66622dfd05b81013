"""The node agent's usage reports to the control plane (POST /api/v1/nodes/usage). No Django.

Invariants:
- `boot_id` is a fresh uuid4 per agent process; `sequence` grows by one per report of that process, so
  (node, boot_id, sequence) identifies a report and the control plane stores it once however often it is sent;
- reports are sent oldest first; an unsent report stays at the head of the queue and is retried (in order) on the
  next tick; a report the control plane refuses for good (a 4xx other than 408/429) is dropped and logged, so one
  bad report never blocks the rest;
- the queue is bounded (`max_queued`): when the control plane is unreachable for that many periods the oldest
  report is dropped (its usage is lost, logged); the grace window (KCAAS_USAGE_GRACE_SECONDS) should cover the
  queue (60 s x 1440 = 24 h by default).
Each report carries absolute values (resident bytes now, counters since boot), so a lost or dropped one loses
at most the interval it alone covered, never more.
"""

from __future__ import annotations

import collections
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

logger = logging.getLogger("kcaas.node.usage")
DEFAULT_MAX_QUEUED = 1440
RETRYABLE_STATUSES = {408, 429}


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _is_permanent_refusal(error: Exception) -> bool:
    """A 4xx answer (other than timeout / rate limit): sending the same report again cannot succeed."""
    status = getattr(error, "status", None)
    return isinstance(status, int) and 400 <= status < 500 and status not in RETRYABLE_STATUSES


class UsageReporter:
    """Builds reports from `snapshot()` ([{"cache_id", "device_bytes", "dram_bytes", "ssd_bytes",
    "bytes_written_total", "tokens_served_total"}]) and sends them with `send(report)` (ControlPlane.usage)."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], list[dict]],
        send: Callable[[dict], dict],
        max_queued: int = DEFAULT_MAX_QUEUED,
        clock: Callable[[], datetime] = _utc_now,
    ):
        self.boot_id = str(uuid.uuid4())
        self._snapshot, self._send, self._clock = snapshot, send, clock
        self._sequence = 0
        self._queue: collections.deque[dict] = collections.deque()
        self._max_queued = max_queued
        self._lock = threading.Lock()  # one tick at a time (the timer thread and the last report at stop)

    @property
    def pending(self) -> list[dict]:
        """The reports not yet accepted, oldest first (a copy)."""
        return list(self._queue)

    def collect(self) -> dict:
        """Take a snapshot now and queue it as the next report."""
        self._sequence += 1
        report = {
            "boot_id": self.boot_id,
            "sequence": self._sequence,
            "sampled_at": self._clock().astimezone(UTC).isoformat(timespec="seconds"),
            "caches": self._snapshot(),
        }
        self._queue.append(report)
        while len(self._queue) > self._max_queued:
            dropped = self._queue.popleft()
            logger.error("usage report %s dropped unsent: the queue holds %d", dropped["sequence"], self._max_queued)
        return report

    def flush(self) -> int:
        """Send queued reports oldest first until one fails to arrive; returns how many the control plane took."""
        sent = 0
        while self._queue:
            report = self._queue[0]
            try:
                self._send(report)
            except OSError as error:  # unreachable, timed out, reset: keep it and retry next tick, in order
                logger.warning("usage report %s not sent (retrying): %s", report["sequence"], error)
                return sent
            except Exception as error:  # noqa: BLE001 - an answer from the control plane
                if not _is_permanent_refusal(error):
                    logger.warning("usage report %s failed (retrying): %s", report["sequence"], error)
                    return sent
                logger.error("usage report %s refused, dropped: %s", report["sequence"], error)
            else:
                sent += 1
            self._queue.popleft()
        return sent

    def tick(self) -> int:
        with self._lock:
            self.collect()
            return self.flush()


class UsageReportLoop:
    """Calls `reporter.tick()` every `interval` seconds on a daemon thread; `stop()` ends it (the agent then sends
    one last report itself)."""

    def __init__(self, reporter: UsageReporter, interval: float):
        self.reporter, self.interval = reporter, interval
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kcaas-usage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.reporter.tick()
            except Exception:
                logger.exception("usage report tick failed")

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
