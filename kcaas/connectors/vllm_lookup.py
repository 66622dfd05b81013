"""The vLLM connector's scheduler-side LOOKUP, bounded: an answer within the deadline or a miss, never a stall of the
engine's scheduling loop (no vLLM import; kcaas/connectors/vllm.py uses it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kcaas.dataplane import DataPlaneClient

logger = logging.getLogger("kcaas.connectors.vllm")

MAX_BACKOFF_S = 30.0


class BoundedLookup:
    """LOOKUP with a deadline: the node's answer within `timeout_s`, else 0 (a miss). After a failure, lookups are
    misses at once for a back-off (1 s, doubling to 30 s while failures go on), so a dead or hung node costs one
    timeout per back-off, not one per request. The first connection is opened here, with `connect_timeout_s`, off
    the engine's path; a reconnect after a failure is bounded by max(10 x timeout_s, 0.5 s).

    `open_client(timeout)` makes a DataPlaneClient of the cache with that socket timeout."""

    def __init__(
        self,
        open_client: Callable[[float], DataPlaneClient],
        timeout_s: float,
        connect_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._open_client, self._timeout, self._clock = open_client, timeout_s, clock
        self._client: DataPlaneClient | None = None
        self._down_until, self._backoff = 0.0, 1.0
        try:
            self._open(connect_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a node down at start-up: misses until it answers
            logger.warning("KCaaS node not reachable at start-up (%s): lookups are misses until it is", exc)
            self.close()

    def _open(self, connect_timeout: float) -> DataPlaneClient:
        client = self._client = self._open_client(connect_timeout)
        client.connect()
        client.settimeout(self._timeout)
        return client

    def __call__(self, prompt) -> int:
        now = self._clock()
        if now < self._down_until:
            return 0
        try:
            client = self._client
            if client is None:  # a reconnect after a failure: bounded too (a hung node)
                client = self._open(max(10 * self._timeout, 0.5))
            found = client.lookup(np.asarray(prompt, dtype=np.int32))
        except Exception as exc:  # noqa: BLE001 - any failure of the node or the network is a miss, never a stall
            self._down_until, self._backoff = now + self._backoff, min(self._backoff * 2, MAX_BACKOFF_S)
            logger.warning(
                "KCaaS lookup failed (%s); lookups are misses for %.0f s", type(exc).__name__, self._down_until - now
            )
            self.close()
            return 0
        self._backoff = 1.0
        return found

    @property
    def down(self) -> bool:
        """Within a back-off: lookups are misses without asking the node."""
        return self._clock() < self._down_until

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
