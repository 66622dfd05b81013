"""Control-queue tasks of the caches room. Each takes ids, loads rows and calls one service; status guards in the
services make redelivery and duplicates no-ops. The node agents send the answers (typed messages of
kcaas/node_protocol/messages.py, by name with `send_task`, as keyword arguments, to the `control` queue:
core.node_answers); beat runs the sweeps."""

import logging

from celery import shared_task

from audit.context import SYSTEM, Actor, acting_as
from caches import migration, reconcile, services, token_cascade
from caches.idempotency import idempotency_records_purge
from core.node_answers import node_answer_task
from kcaas.node_protocol.messages import DetachResult, MigrationProgress, MigrationResult, ProvisionResult

logger = logging.getLogger("kcaas.caches")


@node_answer_task(ProvisionResult)
def provision_result(answer: ProvisionResult) -> str | None:
    """A node's answer to `kcaas.node.provision_cache`: ready (ok, with its data-plane endpoint) or failed.
    Audited as the node's own action."""
    with acting_as(Actor("node", answer.node_id)):
        cache = services.cache_provision_result(
            cache_id=answer.cache_id,
            node_id=answer.node_id,
            ok=answer.ok,
            reason=answer.reason,
            endpoint=answer.endpoint,
        )
    return cache.state if cache is not None else None


@node_answer_task(DetachResult)
def detach_result(answer: DetachResult) -> str | None:
    """A node confirms `kcaas.node.detach_cache`: the pool is gone. Audited as the node's own action."""
    with acting_as(Actor("node", answer.node_id)):
        cache = services.cache_detach_result(cache_id=answer.cache_id, node_id=answer.node_id)
    return cache.state if cache is not None else None


@node_answer_task(MigrationProgress, acks_late=True)
def migration_progress(answer: MigrationProgress) -> str | None:
    """A node's migration progress (status-guarded in caches.migration: duplicates and strays are no-ops)."""
    with acting_as(Actor("node", answer.node_id)):
        row = migration.migration_progress(
            migration_id=answer.migration_id, node_id=answer.node_id, phase=answer.phase, info=dict(answer.info)
        )
    return row.state if row is not None else None


@node_answer_task(MigrationResult, acks_late=True)
def migration_result(answer: MigrationResult) -> str | None:
    """The source's last word on a migration: cutover (audited CACHE_MIGRATED as the node) or failure."""
    with acting_as(Actor("node", answer.node_id)):
        row = migration.migration_result(
            migration_id=answer.migration_id,
            node_id=answer.node_id,
            ok=answer.ok,
            reason=answer.reason,
            info=dict(answer.info),
        )
    return row.state if row is not None else None


@shared_task(name="caches.sweep_leases")
def sweep_leases() -> int:
    """Beat, every few seconds: expire node leases, flag the caches of lost nodes (audited as the system)."""
    with acting_as(SYSTEM):
        return len(services.caches_sweep_leases())


@shared_task(name="caches.cascade_token_revocations")
def cascade_token_revocations() -> int:
    """Beat, every KCAAS_TOKEN_CASCADE_SECONDS: revoke the data tokens of suspended or erased tenants and of revoked
    or expired API keys, and push them to their nodes (caches.token_cascade)."""
    with acting_as(SYSTEM):
        return token_cascade.data_tokens_revoke_cascade()


@shared_task(name="caches.reconcile")
def reconcile_stuck() -> int:
    """Beat, every KCAAS_RECONCILE_SECONDS: end provisionings and detaches that outlived their deadline."""
    with acting_as(SYSTEM):
        return len(reconcile.caches_reconcile_stuck())


@shared_task(name="caches.purge_expired")
def purge_expired() -> int:
    """Beat, hourly: forget expired idempotency keys and long-expired data-token rows."""
    return idempotency_records_purge() + services.data_tokens_purge()


@shared_task(name="caches.expire_migrations")
def expire_migrations() -> int:
    """Beat, every minute: fail migrations no node has moved for KCAAS_MIGRATION_STALL_SECONDS (caches.migration)."""
    with acting_as(SYSTEM):
        return len(migration.migrations_expire())
