"""The node's migration tasks (kcaas/node_protocol/messages.py): migrate_in on the target, migrate_out and
migrate_cutover on the source. No Django. `NodeMigration.register(app, answer)` adds them to the node's Celery app
(node_tasks).

- migrate_in opens the cache's keys (sealed to this node: node_tasks.NodeKeys), provisions the cache at epoch_to (an
  empty pool, idempotent per epoch), tells the listener to expect the named source node, and answers progress
  "ready" with the listener's endpoint;
- migrate_out runs the sender on its own thread (the node's worker is a solo pool: other orders must not wait for
  a long copy), reports progress, fences writes before the last pass ("fenced"), and answers the result; on a
  failure it lifts the fence, so the cache takes writes here again;
- migrate_cutover (after the control plane flipped the placement) answers MOVED for good and detaches the copy.
Every handler is idempotent: a redelivered migrate_in re-provisions nothing, a redelivered migrate_out resumes
(the target lists what it holds), a redelivered cutover finds the cache already detached.

Resume (issue 6): a sender whose transfer breaks (the target was killed, restarts, or does not expect it yet) tries
again, reconnecting, for `resume_seconds` before it answers a failure; the fence is lifted between tries. A second
migrate_out while this node's sender for that migration still runs starts NO second sender: it only updates the
target endpoint the running one reconnects to (the control plane re-sends migrate_out after a target restarted).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time

from gpu_node.agent.tasks import node_task, provision, unsealed_keys
from gpu_node.errors import NodeError
from gpu_node.migration.fence import fences_for
from gpu_node.migration.transfer import Incoming, MigrationListener, MigrationSender
from kcaas.node_protocol.messages import (
    MIGRATE_IN_TASK,
    MigrateAbort,
    MigrateCutover,
    MigrateIn,
    MigrateOut,
    MigrationProgress,
    MigrationResult,
)

logger = logging.getLogger("kcaas.node.migration")


class NodeMigration:
    """One node's migration side: its listener (mutual TLS; started by the caller) and its client TLS context."""

    def __init__(
        self,
        *,
        registry,
        node_id: str,
        listener: MigrationListener,
        client_context: ssl.SSLContext,
        advertise: str | None = None,
        resume_seconds: float = 60.0,
        max_bytes_per_second: float | None = None,
    ):
        """`advertise`: host:port other nodes reach the listener at (default: its bound address).
        `resume_seconds`: how long a broken transfer keeps reconnecting before it is answered as failed.
        `max_bytes_per_second`: each sender's rate cap (KCAAS_NODE_MIGRATION_MAX_BYTES_PER_SECOND; None: unpaced)."""
        self.max_bytes_per_second = max_bytes_per_second
        self.registry, self.node_id, self.listener = registry, str(node_id), listener
        self.client_context, self.advertise, self.resume_seconds = client_context, advertise, resume_seconds
        self.senders: dict[str, threading.Thread] = {}
        self.last_stats: dict[str, dict] = {}
        self._out_lock = threading.Lock()
        self._endpoints: dict[str, str] = {}  # migration id -> the target listener the sender (re)connects to
        self._aborted: set[str] = set()  # migrations the control plane gave up: their sender never fences again

    def register(self, app, answer, keys=None) -> None:
        """Add the migration tasks to `app` (node_tasks.node_task: keyword arguments parsed into their message);
        `keys` (node_tasks.NodeKeys) opens the keys migrate_in carries."""

        @node_task(app, MigrateIn, answer, self.node_id)
        def migrate_in(order: MigrateIn) -> bool:
            hash_key, ssd_key, reason = unsealed_keys(
                keys,
                task=MIGRATE_IN_TASK,
                cache_id=order.cache_id,
                hash_key_box=order.hash_key_box,
                ssd_key_box=order.ssd_key_box,
            )
            if reason is None:
                return False  # sealed to a key this node does not hold: not answered (node_tasks.unsealed_keys)
            ok = False
            if not reason:
                ok, reason = provision(
                    self.registry,
                    order.cache_id,
                    order.spec,
                    order.capacity,
                    hash_key,
                    order.epoch_to,
                    order.tenant_id,
                    ssd_key,
                    network_write_through=order.network_write_through,
                )
            if not ok:
                answer(self._result(order.migration_id, ok=False, reason=reason))
                return False
            self.listener.expect(Incoming(order.migration_id, order.cache_id, order.source_node_id, order.epoch_to))
            endpoint = self.advertise or self.listener.endpoint
            answer(self._progress(order.migration_id, "ready", {"migration_endpoint": endpoint}))
            return True

        @node_task(app, MigrateOut, answer, self.node_id)
        def migrate_out(order: MigrateOut) -> bool:
            return self.start_sender(answer, order)

        @node_task(app, MigrateAbort, answer, self.node_id)
        def migrate_abort(order: MigrateAbort) -> None:
            self.abort(order.migration_id, order.cache_id)

        @node_task(app, MigrateCutover, answer, self.node_id)
        def migrate_cutover(order: MigrateCutover) -> bool:
            fences_for(self.registry).moved(order.cache_id, order.target_endpoint, order.epoch_to)
            return self.registry.detach(cache_id=order.cache_id, epoch=order.epoch_from)

    def _progress(self, migration_id: str, phase: str, info: dict) -> MigrationProgress:
        return MigrationProgress(migration_id=migration_id, node_id=self.node_id, phase=phase, info=info)

    def _result(self, migration_id: str, *, ok: bool, reason: str = "", info: dict | None = None) -> MigrationResult:
        return MigrationResult(migration_id=migration_id, node_id=self.node_id, ok=ok, reason=reason, info=info or {})

    def abort(self, migration_id: str, cache_id: str) -> None:
        """The control plane failed this migration (it stalled, a node was lost): writes resume here (a fence before
        cutover is lifted; a cache that moved for good stays moved) and the sender stops at its next step instead of
        fencing. Idempotent."""
        with self._out_lock:
            self._aborted.add(migration_id)
        fences_for(self.registry).lift(cache_id)
        logger.info("migration %s of cache %s aborted: writes resume here", migration_id, cache_id)

    def aborted(self, migration_id: str) -> bool:
        with self._out_lock:
            return migration_id in self._aborted

    def start_sender(self, answer, order: MigrateOut) -> bool:
        """Start this migration's sender thread, or, while one runs, only point it at the (new) target endpoint.
        Invariant: at most one live sender per migration id on this node. True when a sender was started."""
        migration_id = order.migration_id
        with self._out_lock:
            self._endpoints[migration_id] = order.target_migration_endpoint
            running = self.senders.get(migration_id)
            if running is not None and running.is_alive():
                logger.info(
                    "migration %s: a sender already runs; it reconnects to %s",
                    migration_id,
                    order.target_migration_endpoint,
                )
                return False
            thread = threading.Thread(target=self.send, args=(answer, order), daemon=True, name="migration-send")
            self.senders[migration_id] = thread
        thread.start()
        return True

    def send(self, answer, order: MigrateOut) -> None:
        """Copy, fence, copy the rest, answer; a broken transfer is resumed (reconnect, the target lists what it
        holds) until `resume_seconds` pass. Never raises (the answer says how it ended)."""
        migration_id, cache_id, epoch_to = order.migration_id, order.cache_id, order.epoch_to
        fences = fences_for(self.registry)
        hosted = self.registry.get(cache_id)
        if hosted is None or hosted.epoch != order.epoch_from:
            return answer(self._result(migration_id, ok=False, reason="not_hosted"))
        totals = {"blocks_sent": 0, "bytes_sent": 0, "rounds": 0, "attempts": 0}
        current: list[MigrationSender] = []  # this try's sender (progress adds its live counts to the totals)

        def progress(info: dict) -> None:
            live = current[0].stats
            sent = {
                "bytes_sent": totals["bytes_sent"] + live.bytes_sent,
                "blocks_sent": totals["blocks_sent"] + live.blocks_sent,
            }
            answer(self._progress(migration_id, "copying", {**info, **sent}))

        def fence() -> None:
            if self.aborted(migration_id):
                raise MigrationAborted(migration_id)
            if not fences.fence(cache_id, order.target_endpoint, epoch_to):
                raise TimeoutError("writes in flight did not finish")
            answer(self._progress(migration_id, "fenced", {}))

        deadline = time.monotonic() + self.resume_seconds
        while True:
            with self._out_lock:
                endpoint = self._endpoints.get(migration_id, order.target_migration_endpoint)
            sender = MigrationSender(
                hosted.engine,
                migration_id=migration_id,
                cache_id=cache_id,
                epoch=epoch_to,
                target_endpoint=endpoint,
                target_node_id=order.target_node_id,
                tls_context=self.client_context,
                progress=progress,
                connect_timeout=min(30.0, self.resume_seconds),
                max_bytes_per_second=self.max_bytes_per_second,
            )
            current[:] = [sender]
            try:
                sender.run(fence=fence)
                _add_stats(totals, sender.stats)
                break
            except Exception as exc:  # noqa: BLE001 - any failure is retried, then reported; writes resume here
                _add_stats(totals, sender.stats)
                fences.lift(cache_id)
                if (
                    time.monotonic() >= deadline
                    or self.registry.get(cache_id) is not hosted
                    or self.aborted(migration_id)
                ):
                    logger.warning("migration %s of cache %s failed: %s", migration_id, cache_id, exc)
                    return answer(self._result(migration_id, ok=False, reason=type(exc).__name__, info=dict(totals)))
                logger.info("migration %s of cache %s broke (%s): resuming", migration_id, cache_id, exc)
                time.sleep(0.5)
        info = {"blocks": totals["blocks_sent"], **totals}
        self.last_stats[migration_id] = info
        answer(self._result(migration_id, ok=True, info=info))


class MigrationAborted(NodeError, RuntimeError):
    """The control plane aborted the migration: its sender stops before fencing."""


def _add_stats(totals: dict, stats) -> None:
    totals["blocks_sent"] += stats.blocks_sent
    totals["bytes_sent"] += stats.bytes_sent
    totals["rounds"] += stats.rounds
    totals["attempts"] += 1
