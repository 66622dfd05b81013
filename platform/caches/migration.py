"""Cache migration, control side: Migration rows, orders to the nodes, and the atomic cutover.

    migration_start   pending:  target reserved (fleet), migrate_in sent to the target on commit
    progress "ready"  pending -> copying: the target hosts an empty pool at epoch_to and listens; migrate_out sent
                      to the source (the target's migration endpoint and data-plane endpoint)
    progress "fenced" copying -> cutover: the source answers writes with MOVED and sends the last blocks
    result ok         copying|cutover -> complete, in ONE transaction: cache.node/endpoint/epoch flipped to the
                      target at epoch_to, the source's reservation released, CACHE_MIGRATED audited (last); then
                      migrate_cutover to the source (MOVED for good, detach)
    result failed     -> failed: the target's reservation released, its copy detached (epoch_to)

Invariants: the cache has exactly one serving placement at every instant (tokens are issued for cache.node at
cache.epoch; the flip is one row update); every answer is status-guarded (a duplicate, stale or foreign answer is
a no-op), so Celery redelivery is harmless; orders go through the outbox (fleet.outbox): written with the change,
published after commit, and migrate_in / migrate_out sent again until the node answers them (migrate_in until the
target's "ready" or refusal, migrate_out until the source's result: a re-sent migrate_out while its sender runs only
points the sender at the target again, after a lost result it copies what is missing and answers again).
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import audit_record
from caches.models import Cache, CacheState, Migration, MigrationState
from caches.sealing import SealError, hash_key_unseal, ssd_key_unseal
from caches.services import _lock_cache, cache_key
from core.errors import ConflictError, NotFoundError
from fleet.errors import NoCapacity
from fleet.models import Node, NodeState
from fleet.outbox import order_enqueue, orders_acknowledge, orders_close, seal_for_node
from fleet.services import node_drain, node_place, node_unreserve, nodes_lock
from kcaas.node_protocol.messages import (
    MIGRATE_IN_TASK,
    DetachCache,
    MigrateAbort,
    MigrateCutover,
    MigrateIn,
    MigrateOut,
)

logger = logging.getLogger("kcaas.caches.migration")
REASONS = ("drain", "rebalance", "replica")


class MigrationConflict(ConflictError):
    code = "migration_conflict"


def _reserve_on(node_id, capacity: dict[str, int]) -> Node:
    """Reserve `capacity` on one named node (ready, live lease, room on every tier), row-locked."""
    node = Node.objects.select_for_update(no_key=True).filter(pk=node_id).first()
    if node is None:
        raise NotFoundError("No such node.")
    fits = all(
        getattr(node, f"{t}_capacity_bytes") - getattr(node, f"{t}_reserved_bytes") >= n for t, n in capacity.items()
    )
    live = node.lease_expires_at is not None and node.lease_expires_at > timezone.now()
    if node.state != NodeState.READY or not live or not fits:
        raise NoCapacity("The target node cannot take this cache.", details={"node": str(node_id)})
    Node.objects.filter(pk=node.pk).update(
        **{f"{t}_reserved_bytes": F(f"{t}_reserved_bytes") + n for t, n in capacity.items()}, updated_at=timezone.now()
    )
    return node


@transaction.atomic
def migration_start(*, cache_id, target_node_id=None, reason: str = "rebalance") -> Migration:
    """Order a ready cache moved to `target_node_id` (or where placement puts it). 409 when it is not ready, already
    moving, or the only fitting node is its own."""
    assert reason in REASONS, reason
    cache = _lock_cache(cache_id)
    if cache is None:
        raise NotFoundError("No such cache.")
    if cache.state != CacheState.READY or cache.node_id is None:
        raise MigrationConflict("Only a ready cache can be migrated.", details={"state": cache.state})
    capacity = cache.node_capacity()
    target = _reserve_on(target_node_id, capacity) if target_node_id else node_place(capacity=capacity)
    if target.pk == cache.node_id:
        raise MigrationConflict("The cache is already on that node.")  # rolls the reservation back
    try:
        with transaction.atomic():
            migration = Migration.objects.create(
                cache=cache,
                source_id=cache.node_id,
                target=target,
                reason=reason,
                epoch_from=cache.epoch,
                epoch_to=cache.epoch + 1,
            )
    except IntegrityError:
        raise MigrationConflict("The cache is already being migrated.") from None
    # An earlier failed migration to this node may still be re-sending its detach of the copy it left there, at
    # this same epoch_to: sent after this migration's cutover, it would drop the live cache. This migration owns the
    # target's copy now (migrate_in re-provisions it; its own end detaches it or makes it the serving one).
    orders_close(node_id=target.pk, key=cache_key(cache.pk), reason="superseded: a new migration to this node")
    _order_migrate_in(migration)
    return migration


def _key(migration: Migration, leg: str) -> str:
    """The outbox key of one of a migration's orders: "in" (target), "out" and "cutover" (source)."""
    return f"migration:{migration.pk}:{leg}"


def _order_migrate_in(migration: Migration) -> None:
    order_enqueue(
        node_id=migration.target_id,
        task=MIGRATE_IN_TASK,
        builder="caches.migration.migrate_in_order_message",
        builder_args=[str(migration.pk)],
        key=_key(migration, "in"),
    )


def migrate_in_order_message(migration_id: str) -> MigrateIn | None:
    """The outbox builder of migrate_in (it carries the cache's keys, sealed to the target): None once
    the migration is no longer pending, once its cache left service (a detach, an erasure: the target must not host
    it again after the purge) or when its keys no longer open (shredded)."""
    migration = Migration.objects.select_related("cache").filter(pk=migration_id, state=MigrationState.PENDING).first()
    if migration is None or migration.cache.state not in (CacheState.READY, CacheState.PROVISIONING):
        return None
    try:
        return _migrate_in_message(migration, migration.cache)
    except SealError:
        logger.warning(
            "migration %s: the keys of cache %s do not open; migrate_in not sent", migration.pk, migration.cache_id
        )
        return None


def _migrate_in_message(migration: Migration, cache: Cache) -> MigrateIn:
    """migrate_in's message: the same keys for one migration (epoch_to, hash key, SSD key), so a re-sent order
    re-provisions the very cache the target had (its SSD directory rescans under the same key). The keys are sealed
    to the target node at send time (fleet.outbox.seal_for_node), never in clear on the broker."""
    hash_key = hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)

    def sealed(field: str, key: bytes) -> str:
        return seal_for_node(
            node_id=migration.target_id, task=MIGRATE_IN_TASK, cache_id=cache.pk, field=field, plaintext=key
        )

    ssd_key_box = ""
    if cache.ssd_key_sealed:  # the target's SSD/network tiers seal under the cache's own data key, as the source's
        ssd_key_box = sealed("ssd_key", ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed))
    return MigrateIn(
        migration_id=str(migration.pk),
        cache_id=str(cache.pk),
        spec=cache.spec_dict(),
        capacity=cache.capacity(),
        hash_key_box=sealed("hash_key", hash_key),
        epoch_to=migration.epoch_to,
        source_node_id=str(migration.source_id),
        tenant_id=str(cache.tenant_id),
        ssd_key_box=ssd_key_box,
        network_write_through=cache.network_write_through,
    )


def _lock_migration(migration_id, node_id, *, role: str, states) -> Migration | None:
    try:
        wanted = uuid.UUID(str(migration_id))
    except ValueError:
        return None
    migration = Migration.objects.select_for_update(no_key=True).filter(pk=wanted).first()
    if migration is None or str(getattr(migration, f"{role}_id")) != str(node_id) or migration.state not in states:
        logger.info("ignored migration answer %s from node %s", migration_id, node_id)
        return None
    return migration


@transaction.atomic
def migration_progress(*, migration_id, node_id, phase: str, info: dict) -> Migration | None:
    """A node's progress: the target is ready (migrate_out goes to the source), the source copied some blocks, or
    the source fenced writes (cutover)."""
    if phase == "ready":
        migration = _lock_migration(migration_id, node_id, role="target", states=(MigrationState.PENDING,))
        if migration is not None:
            orders_acknowledge(node_id=migration.target_id, key=_key(migration, "in"), tasks=(MIGRATE_IN_TASK,))
            migration.state = MigrationState.COPYING
            migration.save(update_fields=["state", "updated_at"])
            message = MigrateOut(
                migration_id=str(migration.pk),
                cache_id=str(migration.cache_id),
                epoch_from=migration.epoch_from,
                epoch_to=migration.epoch_to,
                target_node_id=str(migration.target_id),
                target_migration_endpoint=str(info.get("migration_endpoint", "")),
                target_endpoint=str(info.get("endpoint") or migration.target.endpoint),
            )
            order_enqueue(node_id=migration.source_id, message=message, key=_key(migration, "out"))
        return migration
    active = (MigrationState.COPYING, MigrationState.CUTOVER)
    migration = _lock_migration(migration_id, node_id, role="source", states=active)
    if migration is not None:
        migration.blocks_copied = max(migration.blocks_copied, int(info.get("blocks", 0)))
        migration.bytes_copied = max(migration.bytes_copied, int(info.get("bytes_sent", 0)))
        if phase == "fenced":
            migration.state = MigrationState.CUTOVER
        migration.save(update_fields=["state", "blocks_copied", "bytes_copied", "updated_at"])
    return migration


@transaction.atomic
def migration_result(*, migration_id, node_id, ok: bool, reason: str = "", info: dict | None = None):
    """The source's last word: every block verified on the target (cutover) or a failure (roll back). The cache row
    is locked before the migration's (the cache -> migration lock order of migration_start)."""
    active = (MigrationState.PENDING, MigrationState.COPYING, MigrationState.CUTOVER)
    row = Migration.objects.filter(pk=migration_id).values("cache_id").first() if _is_uuid(migration_id) else None
    cache = _lock_cache(row["cache_id"]) if row is not None else None
    migration = _lock_migration(
        migration_id, node_id, role="source" if ok else _failing_role(migration_id, node_id), states=active
    )
    if migration is None:
        return None
    if ok and cache is not None and cache.state == CacheState.READY and cache.epoch == migration.epoch_from:
        return _cutover(migration, cache, info or {})
    return _fail(migration, reason or "cache_changed")


def _failing_role(migration_id, node_id) -> str:
    """A failure may come from either side (the target may refuse to provision)."""
    row = Migration.objects.filter(pk=migration_id).values("target_id").first() if _is_uuid(migration_id) else None
    return "target" if row is not None and str(row["target_id"]) == str(node_id) else "source"


def _is_uuid(value) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _cutover(migration: Migration, cache: Cache, info: dict) -> Migration:
    """The one transaction that moves the cache: node, endpoint, epoch; source released; audited last."""
    old = {"node": str(cache.node_id), "endpoint": cache.endpoint, "epoch": cache.epoch}
    node_unreserve(node_id=migration.source_id, capacity=cache.node_capacity())
    cache.node_id, cache.endpoint, cache.epoch = migration.target_id, migration.target.endpoint, migration.epoch_to
    cache.save(update_fields=["node", "endpoint", "epoch", "updated_at"])
    migration.state = MigrationState.COMPLETE
    migration.blocks_copied = max(migration.blocks_copied, int(info.get("blocks", 0)))
    migration.bytes_copied = max(migration.bytes_copied, int(info.get("bytes_sent", 0)))
    migration.save(update_fields=["state", "blocks_copied", "bytes_copied", "updated_at"])
    _close_orders(migration, "complete")
    # no answer to wait for: the source answers MOVED from then on, and detaches its copy
    cutover = MigrateCutover(
        migration_id=str(migration.pk),
        cache_id=str(cache.pk),
        epoch_from=migration.epoch_from,
        target_endpoint=cache.endpoint,
        epoch_to=migration.epoch_to,
    )
    order_enqueue(node_id=migration.source_id, message=cutover, key=_key(migration, "cutover"), expects_answer=False)
    new = {"node": str(cache.node_id), "endpoint": cache.endpoint, "epoch": cache.epoch}
    audit_record(
        action=AuditAction.CACHE_MIGRATED,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=cache.tenant_id,
        old=old,
        new={**new, "migration": str(migration.pk), "reason": migration.reason},
    )
    return migration


def _fail(migration: Migration, reason: str) -> Migration:
    _fail_state(migration, reason)
    _fail_orders(migration)
    return migration


def _fail_state(migration: Migration, reason: str) -> None:
    """failed, the target's reservation given back (the node locks of a failure)."""
    migration.state = MigrationState.FAILED
    migration.failure_reason = str(reason)[:300]
    migration.save(update_fields=["state", "failure_reason", "updated_at"])
    node_unreserve(node_id=migration.target_id, capacity=migration.cache.node_capacity())


def _fail_orders(migration: Migration) -> None:
    """The orders of a failure (after every node lock): no more migrate_in/out, abort to the source, detach of the
    target's copy."""
    _close_orders(migration, "failed")
    # the source may have fenced writes (or will, when its sender gets there): it takes them again
    abort = MigrateAbort(migration_id=str(migration.pk), cache_id=str(migration.cache_id))
    order_enqueue(node_id=migration.source_id, message=abort, key=_key(migration, "abort"), expects_answer=False)
    cache = migration.cache  # the target's copy goes, at the target's epoch (the cache row keeps its own)
    detach = DetachCache(cache_id=str(cache.pk), epoch=migration.epoch_to, forget_network=False)
    order_enqueue(node_id=migration.target_id, message=detach, key=cache_key(cache.pk))


def _close_orders(migration: Migration, reason: str) -> None:
    """The migration ended: its migrate_in / migrate_out are sent no more."""
    orders_close(node_id=migration.target_id, key=_key(migration, "in"), reason=reason)
    orders_close(node_id=migration.source_id, key=_key(migration, "out"), reason=reason)


@transaction.atomic
def migrations_expire(*, now=None) -> list[uuid.UUID]:
    """End every migration in bounded time: one with no node answer for settings.KCAAS_MIGRATION_STALL_SECONDS
    (a target that never answered migrate_in, a source that died mid-copy or whose result was lost in cutover) fails
    `stalled`, one whose source or target node is lost fails `node_lost`. Each gives the target's reservation back,
    drops the target's partial copy and tells the source to lift its write fence (as any failure does); the cache
    stays where it is, and a new migration may start. Returns the ids failed."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.KCAAS_MIGRATION_STALL_SECONDS)
    active = [MigrationState.PENDING, MigrationState.COPYING, MigrationState.CUTOVER]
    lost = Q(source__state=NodeState.LOST) | Q(target__state=NodeState.LOST)
    ending = (
        Migration.objects.select_for_update(of=("self",), no_key=True)
        .select_related("cache")
        .filter(Q(updated_at__lt=cutoff) | lost, state__in=active)
    )
    ending = list(ending.order_by("id"))
    nodes_lock(node_ids=[migration.target_id for migration in ending])  # the migrations, then their targets
    for migration in ending:
        _fail_state(migration, "stalled" if migration.updated_at < cutoff else "node_lost")
    for migration in ending:  # the orders after every node lock
        _fail_orders(migration)
    return [migration.pk for migration in ending]


@transaction.atomic
def migrations_redrive_node(*, node_id) -> list[uuid.UUID]:
    """The fleet register hook (KCAAS_NODE_REGISTER_HOOKS): a node that registers again (a restart) is the target
    or the source of active migrations whose orders it lost with its process. Each goes back to pending and the
    target gets migrate_in again (same epoch_to and keys: it re-provisions the incoming cache, rescanning its SSD
    and republishing the blocks it had verified); its "ready" answer then sends migrate_out to the source again,
    whose running sender (if it survived) only reconnects. A pending migration whose source restarted needs
    nothing: the target's "ready" will reach the source. Returns the ids re-driven."""
    redriven = []
    active = Migration.objects.select_for_update(of=("self",), no_key=True).filter(
        Q(target_id=node_id, state__in=[MigrationState.PENDING, MigrationState.COPYING, MigrationState.CUTOVER])
        | Q(source_id=node_id, state__in=[MigrationState.COPYING, MigrationState.CUTOVER])
    )
    for migration in active.select_related("cache").order_by("id"):
        cache = migration.cache
        if cache.state != CacheState.READY and not (
            cache.state == CacheState.PROVISIONING and cache.node_id == migration.source_id
        ):
            continue  # the cache is going away: migration_result will fail the move
        migration.state = MigrationState.PENDING
        migration.save(update_fields=["state", "updated_at"])
        _order_migrate_in(migration)
        logger.info("migration %s re-driven: node %s registered again", migration.pk, node_id)
        redriven.append(migration.pk)
    return redriven


def node_drain_caches(*, node_id) -> list[Migration]:
    """Drain a node: no new placements (fleet node_drain, audited NODE_DRAINING) and a migration for every ready
    cache on it, each to where placement puts it. A cache that cannot move now (no room) is left for a retry.
    The drain commits first and each migration starts in a transaction of its own: the node's row lock is never
    held while a cache is locked (the cache -> node lock order; a detach answered meanwhile would deadlock).
    A refused drain (the node is not ready or cordoned) changes nothing."""
    node_drain(node_id=node_id)
    started = []
    hosted = Cache.objects.filter(node_id=node_id, state=CacheState.READY).order_by("id")
    for cache_id in hosted.values_list("id", flat=True):
        try:
            with transaction.atomic():
                started.append(migration_start(cache_id=cache_id, reason="drain"))
        except (MigrationConflict, NoCapacity) as refusal:
            logger.warning("drain of node %s: cache %s not moved now: %s", node_id, cache_id, refusal)
    return started
