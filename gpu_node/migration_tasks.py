"""The node's migration tasks (kcaas/node_messages.py): migrate_in on the target, migrate_out and migrate_cutover on
the source. No Django. `NodeMigration.register(app, answer)` adds them to the node's Celery app (node_tasks).

- migrate_in provisions the cache at epoch_to (an empty pool, idempotent per epoch), tells the listener to expect
  the named source node, and answers progress "ready" with the listener's endpoint;
- migrate_out runs the sender on its own thread (the node's worker is a solo pool: other orders must not wait for
  a long copy), reports progress, fences writes before the last pass ("fenced"), and answers the result; on a
  failure it lifts the fence, so the cache takes writes here again;
- migrate_cutover (after the control plane flipped the placement) answers MOVED for good and detaches the copy.
Every handler is idempotent: a redelivered migrate_in re-provisions nothing, a redelivered migrate_out resumes
(the target lists what it holds), a redelivered cutover finds the cache already detached.
"""

from __future__ import annotations

import logging
import ssl
import threading

from gpu_node.migration import Incoming, MigrationListener, MigrationSender
from gpu_node.migration_fence import fences_for
from gpu_node.node_tasks import provision
from kcaas.node_messages import (
    MIGRATE_CUTOVER_TASK,
    MIGRATE_IN_TASK,
    MIGRATE_OUT_TASK,
    MIGRATION_PROGRESS_TASK,
    MIGRATION_RESULT_TASK,
)

logger = logging.getLogger("kcaas.node.migration")


class NodeMigration:
    """One node's migration side: its listener (mutual TLS; started by the caller) and its client TLS context."""

    def __init__(self, *, registry, node_id: str, listener: MigrationListener, client_context: ssl.SSLContext,
                 advertise: str | None = None):  # fmt: skip
        """`advertise`: host:port other nodes reach the listener at (default: its bound address)."""
        self.registry, self.node_id, self.listener = registry, str(node_id), listener
        self.client_context, self.advertise = client_context, advertise
        self.senders: dict[str, threading.Thread] = {}
        self.last_stats = {}

    def register(self, app, answer) -> None:
        @app.task(name=MIGRATE_IN_TASK, shared=False)
        def migrate_in(migration_id, cache_id, spec, capacity, hash_key_b64, epoch_to, source_node_id,
                       tenant_id="", ssd_key_b64="") -> bool:  # fmt: skip
            ok, reason = provision(self.registry, cache_id, spec, capacity, hash_key_b64, int(epoch_to), tenant_id,
                                   ssd_key_b64)  # fmt: skip
            if not ok:
                answer(MIGRATION_RESULT_TASK, [migration_id, self.node_id, False, reason, {}])
                return False
            self.listener.expect(Incoming(str(migration_id), str(cache_id), str(source_node_id), int(epoch_to)))
            answer(MIGRATION_PROGRESS_TASK, [migration_id, self.node_id, "ready",
                                             {"migration_endpoint": self.advertise or self.listener.endpoint}])  # fmt: skip
            return True

        @app.task(name=MIGRATE_OUT_TASK, shared=False)
        def migrate_out(migration_id, cache_id, epoch_from, epoch_to, target_node_id, target_migration_endpoint,
                        target_endpoint) -> bool:  # fmt: skip
            args = (str(migration_id), str(cache_id), int(epoch_from), int(epoch_to), str(target_node_id),
                    str(target_migration_endpoint), str(target_endpoint))  # fmt: skip
            thread = threading.Thread(target=self.send, args=(answer, *args), daemon=True, name="migration-send")
            self.senders[str(migration_id)] = thread
            thread.start()
            return True

        @app.task(name=MIGRATE_CUTOVER_TASK, shared=False)
        def migrate_cutover(migration_id, cache_id, epoch_from, target_endpoint, epoch_to) -> bool:
            fences_for(self.registry).moved(str(cache_id), str(target_endpoint), int(epoch_to))
            return self.registry.detach(cache_id=str(cache_id), epoch=int(epoch_from))

    def send(self, answer, migration_id, cache_id, epoch_from, epoch_to, target_node_id, migration_endpoint,
             target_endpoint) -> None:  # fmt: skip
        """Copy, fence, copy the rest, answer. Never raises (the answer says how it ended)."""
        fences = fences_for(self.registry)
        hosted = self.registry.get(cache_id)
        if hosted is None or hosted.epoch != epoch_from:
            return answer(MIGRATION_RESULT_TASK, [migration_id, self.node_id, False, "not_hosted", {}])
        def progress(info: dict) -> None:
            answer(MIGRATION_PROGRESS_TASK, [migration_id, self.node_id, "copying", info])

        sender = MigrationSender(hosted.engine, migration_id=migration_id, cache_id=cache_id, epoch=epoch_to,
                                 target_endpoint=migration_endpoint, target_node_id=target_node_id,
                                 tls_context=self.client_context, progress=progress)  # fmt: skip

        def fence() -> None:
            if not fences.fence(cache_id, target_endpoint, epoch_to):
                raise TimeoutError("writes in flight did not finish")
            answer(MIGRATION_PROGRESS_TASK, [migration_id, self.node_id, "fenced", {}])

        try:
            stats = sender.run(fence=fence)
        except Exception as exc:  # noqa: BLE001 - any failure is reported, and the cache takes writes again
            logger.warning("migration %s of cache %s failed: %s", migration_id, cache_id, exc)
            fences.lift(cache_id)
            return answer(MIGRATION_RESULT_TASK, [migration_id, self.node_id, False, type(exc).__name__, {}])
        info = {"blocks": stats.blocks_sent, "bytes_sent": stats.bytes_sent, "rounds": stats.rounds}
        self.last_stats[migration_id] = info
        answer(MIGRATION_RESULT_TASK, [migration_id, self.node_id, True, "", info])
