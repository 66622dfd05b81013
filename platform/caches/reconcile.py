"""The reconciler: every cache leaves `provisioning` and `detaching` in bounded time.

The outbox (fleet.outbox) sends a cache's order again until its node answers, which covers a lost message or a lost
answer. What it cannot cover is a node that never answers while its lease stays live (a wedged worker, a queue
nobody consumes). Beat runs `caches_reconcile_stuck` every KCAAS_RECONCILE_SECONDS:

    provisioning (or pending) for KCAAS_PROVISION_DEADLINE_SECONDS -> failed `provisioning_timeout`: the reservation
        is released and the node is ordered to drop whatever it made (a detach, which supersedes the provisioning);
        `node_sealing_key_missing` instead when the node registered no sealing key, so no order with the cache's
        keys could be sent to it (fleet.outbox.seal_for_node: keys never go in clear)
    detaching for KCAAS_DETACH_DEADLINE_SECONDS -> detached, `detach_unconfirmed`: the reservation is released (the
        cache's tokens were revoked when the detach began, so nothing reaches its pool); its detach order stays open,
        sent until the node answers (or the order expires, or the node is lost): a detach that a broker outage kept
        from a live node still reaches it, so its pool does not outlive the reservation it no longer has

Both are audited as the system's actions. Candidates are locked in id order, then their nodes in id order, then
the orders (the cache -> node -> order lock order). Status-guarded like every transition: a node answer that
arrives after the deadline finds the cache failed or detached and changes nothing.

And a `ready` cache the node no longer reports in its heartbeat's resident snapshot (its pool gone without an
agent restart, or its readiness taken from a stale answer) is provisioned again: `caches_reconcile_resident`, the
heartbeat hook.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.actions import AuditAction
from audit.context import SYSTEM
from caches.models import Cache, CacheState
from caches.services import (
    DETACH_UNCONFIRMED,
    NODE_SEALING_KEY_MISSING,
    PROVISIONING_TIMEOUT,
    _audit,
    _order_detach,
    _release,
    audit_cache_emptied,
    reprovision_emptied,
)
from fleet.services import nodes_lock

logger = logging.getLogger("kcaas.caches")
RESIDENT_GRACE_HEARTBEATS = 3  # a ready cache missing from this many heartbeat intervals' snapshots is lost


@transaction.atomic
def caches_reconcile_stuck(*, now: datetime | None = None) -> list[uuid.UUID]:
    """End the provisionings and detaches that outlived their deadline; returns the ids of the caches changed."""
    now = now or timezone.now()
    provisioning_before = now - timedelta(seconds=settings.KCAAS_PROVISION_DEADLINE_SECONDS)
    detaching_before = now - timedelta(seconds=settings.KCAAS_DETACH_DEADLINE_SECONDS)
    stuck = _lock_stuck(provisioning_before, detaching_before)
    nodes = {node.pk: node for node in nodes_lock(node_ids=[cache.node_id for cache in stuck])}  # then their nodes
    events = []
    for cache in stuck:
        old = {"state": cache.state, "failure_reason": cache.failure_reason}
        _release(cache)
        if cache.state == CacheState.DETACHING:
            cache.state, cache.failure_reason = CacheState.DETACHED, DETACH_UNCONFIRMED
        else:
            keyless = cache.node_id in nodes and not nodes[cache.node_id].sealing_public_key
            cache.state = CacheState.FAILED
            cache.failure_reason = NODE_SEALING_KEY_MISSING if keyless else PROVISIONING_TIMEOUT
        cache.save(update_fields=["state", "failure_reason", "updated_at"])
        events.append((cache, old))
    for cache, _ in events:  # the orders after every node lock (a detach already under way keeps its order)
        if cache.state == CacheState.FAILED and cache.node_id is not None:
            _order_detach(cache)
    for cache, old in events:  # audit events last: every cache, node and order lock is taken by now
        logger.warning(
            "cache %s: %s for too long, now %s (%s)", cache.pk, old["state"], cache.state, cache.failure_reason
        )
        action = AuditAction.CACHE_DETACHED if cache.state == CacheState.DETACHED else AuditAction.CACHE_FAILED
        _audit(action, cache, old=old, new={"state": cache.state, "failure_reason": cache.failure_reason}, actor=SYSTEM)
    return [cache.pk for cache, _ in events]


def _lock_stuck(provisioning_before: datetime, detaching_before: datetime) -> list[Cache]:
    """The stuck caches, row-locked in id order."""
    stuck = Q(state__in=[CacheState.PENDING, CacheState.PROVISIONING], updated_at__lt=provisioning_before) | Q(
        state=CacheState.DETACHING, updated_at__lt=detaching_before
    )
    return list(Cache.objects.select_for_update(of=("self",), no_key=True).filter(stuck).order_by("id"))


@transaction.atomic
def caches_reconcile_resident(*, node_id, resident_cache_ids, now: datetime | None = None) -> list[uuid.UUID]:
    """The heartbeat hook (settings.KCAAS_NODE_HEARTBEAT_RECONCILER): the node's resident snapshot names every cache
    it hosts. A cache placed on it that the control plane believes `ready`, settled for longer than
    RESIDENT_GRACE_HEARTBEATS heartbeat intervals, but absent from the snapshot has lost its pool without the agent
    restarting (or its readiness came from a stale answer): it is provisioned again (same epoch and keys, as a
    re-registration would) and reads `provisioning` until the node answers. The grace keeps a snapshot taken just
    before a cache became ready from looking like a loss. Returns the ids re-provisioned."""
    now = now or timezone.now()
    settled = now - timedelta(seconds=RESIDENT_GRACE_HEARTBEATS * settings.KCAAS_NODE_HEARTBEAT_SECONDS)
    held = {str(cache_id) for cache_id in resident_cache_ids}
    missing = [
        cache
        for cache in Cache.objects.select_for_update(of=("self",), no_key=True)
        .filter(node_id=node_id, state=CacheState.READY, updated_at__lt=settled)
        .order_by("id")
        if str(cache.pk) not in held
    ]
    for cache in missing:
        logger.warning("node %s no longer reports cache %s: provisioning it again", node_id, cache.pk)
        reprovision_emptied(cache)
    for cache in missing:
        _audit(
            AuditAction.CACHE_REPROVISIONED,
            cache,
            old={"state": CacheState.READY},
            new={"state": cache.state},
            actor=SYSTEM,
        )
        audit_cache_emptied(cache, actor=SYSTEM)
    return [cache.pk for cache in missing]
