"""Writes to the node registry: creation with a credential, registration, heartbeats, cordon/drain, placement and
reservations, lease expiry.

Locking: every service that changes a node takes its row lock (SELECT ... FOR UPDATE) first, and the ones that lock
several rows (`node_place`, `nodes_expire_leases`) lock them in primary-key order, so two of them never deadlock.
A caller that locks node rows itself must do so after `node_place`, not before.
"""

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Max, Q
from django.db.models.functions import Greatest
from django.utils import timezone

from audit.actions import AuditAction
from audit.context import SYSTEM
from audit.services import audit_record
from core.errors import NotFoundError
from core.metrics import NODE_LEASE_EXPIRIES, PLACEMENT_FAILURES
from fleet import pki, samples
from fleet.credentials import credential_new
from fleet.errors import (
    EndpointInUse,
    InvalidCapacity,
    InvalidEndpoint,
    InvalidNodeName,
    InvalidNodeState,
    InvalidSealingKey,
    NoCapacity,
    NodeNameTaken,
    ReregisterRequired,
)
from fleet.models import RESIDENT_TIERS, TIERS, Node, NodeState
from fleet.validators import NODE_NAME_RE, capacity_errors, endpoint_error, endpoint_normalize
from kcaas.node_protocol.sealing import public_key_bytes
from kcaas.units import human_bytes

logger = logging.getLogger("kcaas.fleet")


@dataclass(frozen=True, slots=True)
class IssuedNode:
    node: Node
    credential: str  # the raw node credential: shown to staff once, never stored


@dataclass(frozen=True, slots=True)
class NodeRegistration:
    node: Node
    certificate: str | None = None  # PEM node certificate (fleet.pki) when the agent sent a CSR
    ca_certificate: str | None = None  # PEM platform CA certificate, with `certificate`


@dataclass(frozen=True, slots=True)
class NodeCertificate:
    certificate: str
    ca_certificate: str


def _lock(node_id: uuid.UUID) -> Node:
    """The node's row, locked until the transaction ends; 404 not_found when there is none."""
    node = Node.objects.select_for_update(no_key=True).filter(pk=node_id).first()
    if node is None:
        raise NotFoundError("No such node.", details={"node_id": str(node_id)})
    return node


def nodes_lock(*, node_ids) -> list[Node]:
    """Lock the named nodes (ids, repeats and None ignored) in id order, as the lock order wants, before a caller
    that releases several reservations (node_unreserve) in an order of its own; returns them."""
    wanted = {node_id for node_id in node_ids if node_id is not None}
    return list(Node.objects.select_for_update(no_key=True).filter(pk__in=wanted).order_by("id")) if wanted else []


def _lease_until(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.KCAAS_NODE_LEASE_SECONDS)


def _checked_capacity(capacity: object, *, require_all: bool) -> dict[str, int]:
    """A full {tier: bytes} mapping (missing tiers 0) after validation; InvalidCapacity (400) otherwise."""
    errors = capacity_errors(capacity, require_all=require_all)
    if errors:
        raise InvalidCapacity("The capacity is invalid.", details={"capacity": errors})
    checked: dict = capacity  # type: ignore[assignment]  # a dict: capacity_errors found nothing wrong
    return {tier: int(checked.get(tier, 0)) for tier in TIERS}


def _set_capacity(node: Node, capacity: dict[str, int]) -> None:
    for tier, nbytes in capacity.items():
        setattr(node, f"{tier}_capacity_bytes", nbytes)
    for tier in TIERS:
        if node.capacity[tier] < node.reserved[tier]:
            logger.warning("node %s reports %s capacity below its reservations", node.pk, tier)


# ---- lifecycle ------------------------------------------------------------------------------------------------------


@transaction.atomic
def node_create(*, name: str) -> IssuedNode:
    """A node in state `registering` and its credential, returned once. Names are unique (409 node_name_taken)."""
    if not isinstance(name, str) or not NODE_NAME_RE.match(name):
        raise InvalidNodeName("A node name is 1-100 letters, digits, '.', '_' or '-', starting alphanumeric.")
    credential = credential_new()
    try:
        with transaction.atomic():
            node = Node.objects.create(
                name=name, credential_public_id=credential.public_id, credential_hash=credential.secret_hash
            )
    except IntegrityError:
        raise NodeNameTaken("A node with this name exists.", details={"name": name}) from None
    audit_record(
        action=AuditAction.NODE_CREATED,
        target_type="node",
        target_id=node.pk,
        new={"name": node.name, "state": node.state, "credential_public_id": credential.public_id},
    )
    return IssuedNode(node=node, credential=credential.raw)


# What a (re-)registration may change, as the audit trail records it (lease times are renewals, not changes).
_REGISTERED_FIELDS = (
    "state",
    "endpoint",
    "device_capacity_bytes",
    "dram_capacity_bytes",
    "ssd_capacity_bytes",
    "registered_at",
    "sealing_public_key",
)


@transaction.atomic
def node_register(
    *,
    node_id: uuid.UUID,
    endpoint: str,
    capacity: dict[str, int],
    now: datetime | None = None,
    csr: str | None = None,
    sealing_public_key: str | None = None,
) -> NodeRegistration:
    """(Re-)registration by the agent itself: endpoint and whole capacity recorded, lease started.

    A new (`registering`) or `lost` node becomes `ready`; a cordoned or draining node keeps that state (an agent
    restart does not undo an operator's decision); the node id never changes. Reservations are kept: the caches
    placed on the node are still the control plane's to release. 409 endpoint_in_use when another live node
    answers on the same endpoint. With a `csr` the platform CA issues the node's certificate for the new endpoint
    in the same transaction (a bad CSR refuses the whole registration, 400 csr_*).

    `sealing_public_key` (base64 X25519, kcaas/node_protocol/sealing.py) is what the keys in this node's orders are
    sealed to from now on; the credential that authenticated the registration binds it to this node. A registration
    without one (an agent older than key sealing) clears it: such a node is sent no key at all
    (fleet.outbox.seal_for_node). 400 invalid_sealing_key for a key nothing can be sealed to.
    """
    problem = endpoint_error(endpoint)
    if problem:
        raise InvalidEndpoint(f"The endpoint {problem}.", details={"endpoint": problem})
    if sealing_public_key:
        try:
            public_key_bytes(sealing_public_key)
        except ValueError as error:
            raise InvalidSealingKey(f"The sealing public key is unusable: {error}.") from None
    if csr is not None:
        pki.csr_public_key(csr)  # refuse a bad CSR before anything changes
    checked = _checked_capacity(capacity, require_all=True)
    now = now or timezone.now()
    node = _lock(node_id)
    before = {field: getattr(node, field) for field in _REGISTERED_FIELDS}
    node.endpoint = endpoint_normalize(endpoint)
    node.sealing_public_key = sealing_public_key or ""
    _set_capacity(node, checked)
    if node.state in (NodeState.REGISTERING, NodeState.LOST):
        node.state = NodeState.READY
    node.registered_at = node.last_heartbeat_at = now
    node.lease_expires_at = _lease_until(now)
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError:
        raise EndpointInUse("Another live node answers on this endpoint.", details={"endpoint": endpoint}) from None
    changed = [field for field in _REGISTERED_FIELDS if getattr(node, field) != before[field]]
    audit_record(
        action=AuditAction.NODE_REGISTERED,
        target_type="node",
        target_id=node.pk,
        old={field: before[field] for field in changed},
        new={field: getattr(node, field) for field in changed},
    )
    if csr is None:
        return NodeRegistration(node=node)
    certificate, ca_certificate = pki.node_certificate_issue(node=node, csr_pem=csr, now=now)
    return NodeRegistration(node=node, certificate=certificate, ca_certificate=ca_certificate)


@transaction.atomic
def node_certificate_renew(*, node_id: uuid.UUID, csr: str, now: datetime | None = None) -> NodeCertificate:
    """A fresh certificate for a registered, live node from a fresh CSR (the agent renews at half-life).

    409 reregister_required for a node that is lost or never registered (its endpoint is not known to be live);
    400 csr_* for a bad CSR."""
    node = _lock(node_id)
    if node.state in (NodeState.REGISTERING, NodeState.LOST) or not node.endpoint:
        raise ReregisterRequired(
            "This node must register again before renewing its certificate.", details={"state": node.state}
        )
    certificate, ca_certificate = pki.node_certificate_issue(node=node, csr_pem=csr, now=now)
    return NodeCertificate(certificate=certificate, ca_certificate=ca_certificate)


@transaction.atomic
def node_heartbeat(
    *,
    node_id: uuid.UUID,
    capacity: dict[str, int],
    resident: list[dict] | None = None,
    now: datetime | None = None,
) -> Node:
    """Lease renewal with the node's current capacity and, optionally, its per-cache resident bytes.

    `resident` is an absolute snapshot ([{"cache_id", "device_bytes", "dram_bytes", "ssd_bytes", "network_bytes",
    optionally "hit_tokens", "miss_tokens"}]) that replaces the previous one; None keeps the previous one. A `lost` or
    never-registered node is refused with 409 reregister_required: only register brings it back, so the caches
    room has seen it lost before it is ready again.
    A node whose lease has passed but that no sweep has marked lost yet is renewed: it was never declared lost.
    """
    checked = _checked_capacity(capacity, require_all=True)
    now = now or timezone.now()
    node = _lock(node_id)
    if node.state in (NodeState.REGISTERING, NodeState.LOST):
        raise ReregisterRequired("This node must register before it heartbeats.", details={"state": node.state})
    _set_capacity(node, checked)
    if resident is not None:
        node.resident_snapshot = _snapshot(resident, now)
        samples.samples_record(node=node, snapshot=node.resident_snapshot, now=now)  # the console's time series
    node.last_heartbeat_at = now
    node.lease_expires_at = _lease_until(now)
    node.save()
    return node


SNAPSHOT_COUNTERS = ("hit_tokens", "miss_tokens")  # kept per cache when the agent reports them


def _snapshot(resident: list[dict], now: datetime) -> dict:
    """{"reported_at", "caches": {id: {tier: bytes, and hit_tokens/miss_tokens when reported}}}."""
    caches = {str(entry["cache_id"]): _snapshot_entry(entry) for entry in resident}
    return {"reported_at": now.isoformat(), "caches": caches}


def _snapshot_entry(entry: dict) -> dict:
    kept = {tier: int(entry.get(f"{tier}_bytes", 0)) for tier in RESIDENT_TIERS}
    kept.update({name: int(entry[name]) for name in SNAPSHOT_COUNTERS if entry.get(name) is not None})
    return kept


def _transition(node_id: uuid.UUID, *, allowed: set[str], target: str, action: str, audit: AuditAction) -> Node:
    node = _lock(node_id)
    if node.state == target:
        return node  # idempotent: repeating the order changes nothing (and writes no event)
    if node.state not in allowed:
        raise InvalidNodeState(
            f"A {node.state} node cannot be {action}.", details={"state": node.state, "allowed": sorted(allowed)}
        )
    old_state, node.state = node.state, target
    node.save(update_fields=["state", "updated_at"])
    audit_record(action=audit, target_type="node", target_id=node.pk, old={"state": old_state}, new={"state": target})
    return node


@transaction.atomic
def node_cordon(*, node_id: uuid.UUID) -> Node:
    """ready -> cordoned: no new placements, hosted caches stay. Idempotent; other states are 409."""
    return _transition(
        node_id,
        allowed={NodeState.READY},
        target=NodeState.CORDONED,
        action="cordoned",
        audit=AuditAction.NODE_CORDONED,
    )


@transaction.atomic
def node_uncordon(*, node_id: uuid.UUID) -> Node:
    """cordoned or draining -> ready: the node takes new placements again. Idempotent on a ready node; other states
    are 409. Uncordoning a draining node (a drain finished, or stuck because its migrations failed) cancels nothing:
    migrations of its caches still in flight go on and a completed one still moves its cache away; a failed one
    leaves the cache here, ready; a cache the drain could not move stays. The console and REST uncordon call this."""
    return _transition(
        node_id,
        allowed={NodeState.CORDONED, NodeState.DRAINING},
        target=NodeState.READY,
        action="uncordoned",
        audit=AuditAction.NODE_UNCORDONED,
    )


@transaction.atomic
def node_drain(*, node_id: uuid.UUID) -> Node:
    """ready/cordoned -> draining: no new placements while its caches are moved away (migration orchestration)."""
    allowed = {NodeState.READY, NodeState.CORDONED}
    return _transition(
        node_id, allowed=allowed, target=NodeState.DRAINING, action="drained", audit=AuditAction.NODE_DRAINING
    )


@transaction.atomic
def nodes_expire_leases(*, now: datetime | None = None) -> list[uuid.UUID]:
    """Nodes whose lease passed become `lost`; returns their ids (the caller flags their caches in the same
    transaction). Each is audited (NODE_LOST, actor system); a caller that still locks rows after this uses
    `nodes_expire_unrecorded` and `nodes_lost_record` instead (the audit chain's lock must be the last one taken).
    """
    lost = nodes_expire_unrecorded(now=now)
    nodes_lost_record(lost=lost)
    return list(lost)


@transaction.atomic
def nodes_expire_unrecorded(*, now: datetime | None = None) -> dict[uuid.UUID, str]:
    """`nodes_expire_leases` without the audit events: {node id: the state it was lost from}, in id order. The
    caller must pass the result to `nodes_lost_record` before its transaction ends.

    Applies to ready, draining and cordoned nodes: a cordoned node still hosts caches, so its death must be seen.
    Rows are locked in id order; PostgreSQL re-checks the lease condition on a row a concurrent heartbeat just
    renewed, so a node that heartbeat in time is never marked lost.
    """
    now = now or timezone.now()
    live = [NodeState.READY, NodeState.DRAINING, NodeState.CORDONED]
    expired = (
        Node.objects.select_for_update(no_key=True).filter(state__in=live, lease_expires_at__lt=now).order_by("id")
    )
    lost = dict(expired.values_list("id", "state"))
    if lost:
        Node.objects.filter(pk__in=list(lost)).update(state=NodeState.LOST, updated_at=timezone.now())
        logger.warning("nodes lost (lease expired): %s", ", ".join(map(str, lost)))
        transaction.on_commit(lambda: NODE_LEASE_EXPIRIES.inc(len(lost)))
    return lost


def nodes_lost_record(*, lost: dict[uuid.UUID, str]) -> None:
    """One NODE_LOST event per node {id: previous state} that a lease sweep marked lost, as the system."""
    for node_id, previous_state in lost.items():
        audit_record(
            action=AuditAction.NODE_LOST,
            target_type="node",
            target_id=node_id,
            actor=SYSTEM,
            old={"state": previous_state},
            new={"state": NodeState.LOST},
        )


# ---- placement ------------------------------------------------------------------------------------------------------


@transaction.atomic
def node_place(*, capacity: dict[str, int], now: datetime | None = None) -> Node:
    """Reserve `capacity` ({tier: bytes}, missing tiers 0) on the best-fitting node and return that node.

    Rule (best fit): the candidates are the `ready` nodes whose lease is still running and on which every requested
    tier has at least the requested bytes free (capacity - reserved). Among them the winner leaves the fewest free
    bytes on the primary tier afterwards, the primary tier being the fastest tier requested with a positive byte
    count (device, then dram, then ssd); ties go to the fewest free bytes left on the other requested tiers in that
    order, then to the node name. Draining, cordoned, lost and registering nodes are never chosen. Best fit keeps
    large holes free for large caches.

    Concurrency: the candidate rows are locked (SELECT ... FOR UPDATE, id order) in the caller's transaction, which
    keeps them locked until it commits; a concurrently changed row is re-checked by PostgreSQL against the fit
    condition before it is returned, so two placements can never together reserve past a node's capacity.
    Raises InvalidCapacity (400) for a bad mapping or one asking for nothing, NoCapacity (503 no_capacity) when no
    node fits.
    """
    want = _checked_capacity(capacity, require_all=False)
    requested = [tier for tier in TIERS if want[tier] > 0]
    if not requested:
        raise InvalidCapacity("A placement must ask for bytes on at least one tier.", details={"capacity": want})
    now = now or timezone.now()
    fits = Q()
    for tier in requested:
        fits &= Q(**{f"{tier}_capacity_bytes__gte": F(f"{tier}_reserved_bytes") + want[tier]})
    live = Node.objects.filter(state=NodeState.READY, lease_expires_at__gt=now)
    candidates = list(live.filter(fits).select_for_update(no_key=True).order_by("id"))
    if not candidates:
        PLACEMENT_FAILURES.labels(reason=NoCapacity.code).inc()
        raise _no_capacity(want, live)
    best = min(candidates, key=lambda node: _fit_rank(node, want, requested))
    Node.objects.filter(pk=best.pk).update(
        **{f"{tier}_reserved_bytes": F(f"{tier}_reserved_bytes") + want[tier] for tier in requested},
        updated_at=timezone.now(),
    )
    best.refresh_from_db()
    return best


NODE_CAPACITY_SETTINGS = {
    "device": "KCAAS_NODE_DEVICE_BYTES",
    "dram": "KCAAS_NODE_DRAM_BYTES",
    "ssd": "KCAAS_NODE_SSD_BYTES",
}


def _no_capacity(want: dict[str, int], live) -> NoCapacity:
    """The refusal, with the largest free bytes per tier on any live ready node (fleet-wide maxima only: no node
    names, nothing about who holds the rest) and a hint naming the node agent settings that size each tier."""
    largest = live.aggregate(
        **{tier: Max(Greatest(F(f"{tier}_capacity_bytes") - F(f"{tier}_reserved_bytes"), 0)) for tier in TIERS}
    )
    largest_free = {tier: int(largest[tier] or 0) for tier in TIERS}
    short = [tier for tier in TIERS if want[tier] > largest_free[tier]]
    settings_named = " / ".join(NODE_CAPACITY_SETTINGS[tier] for tier in short or TIERS)
    asked = ", ".join(
        f"{tier} {human_bytes(want[tier])} asked, {human_bytes(largest_free[tier])} free at most"
        for tier in short or [t for t in TIERS if want[t]]
    )
    return NoCapacity(
        f"No node has the requested capacity free ({asked}). Ask for at most `largest_free` bytes per tier, or give "
        f"the node agents more ({settings_named}).",
        details={
            "requested": want,
            "largest_free": largest_free,
            "hint": f"Node agents size their tiers from {settings_named} (bytes).",
        },
    )


def _fit_rank(node: Node, want: dict[str, int], requested: list[str]) -> tuple:
    free = node.free
    return (*(free[tier] - want[tier] for tier in requested), node.name)


@transaction.atomic
def node_unreserve(*, node_id: uuid.UUID, capacity: dict[str, int]) -> Node:
    """Give back bytes a placement reserved (detach, failed provisioning, migration away).

    The caller guarantees it releases each reservation once (its own status guard). Releasing more than is
    reserved is clamped at zero and logged, never stored as a negative reservation.
    """
    give_back = _checked_capacity(capacity, require_all=False)
    node = _lock(node_id)
    for tier, nbytes in give_back.items():
        reserved = getattr(node, f"{tier}_reserved_bytes")
        if nbytes > reserved:
            logger.error("node %s: releasing %d %s bytes but only %d reserved", node.pk, nbytes, tier, reserved)
        setattr(node, f"{tier}_reserved_bytes", max(0, reserved - nbytes))
    node.save(update_fields=[f"{tier}_reserved_bytes" for tier in TIERS] + ["updated_at"])
    return node
