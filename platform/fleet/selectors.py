"""Reads of the node registry. Writes live in fleet.services."""

import uuid
from dataclasses import dataclass

from django.db.models import Count, QuerySet, Sum

from core.errors import NotFoundError
from fleet.models import TIERS, Node, NodeState


def node_list(*, state: str | None = None) -> QuerySet[Node]:
    """All nodes ordered by name, optionally only those in one state."""
    nodes = Node.objects.order_by("name", "id")
    if state is not None:
        nodes = nodes.filter(state=state)
    return nodes


def node_get(*, node_id: uuid.UUID) -> Node:
    """The node, or a 404 `not_found`."""
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise NotFoundError("No such node.", details={"node_id": str(node_id)})
    return node


def node_get_by_credential(*, public_id: str) -> Node | None:
    """The node whose credential has this public id (the authentication lookup), or None."""
    return Node.objects.filter(credential_public_id=public_id).first()


# ---- console aggregations (read-only) -------------------------------------------------------------------------------

LIVE_STATES = (NodeState.READY, NodeState.DRAINING, NodeState.CORDONED)


@dataclass(frozen=True, slots=True)
class TierUse:
    """One tier across a set of nodes: capacity, reserved bytes and the resident bytes last reported."""

    tier: str
    capacity_bytes: int
    reserved_bytes: int
    resident_bytes: int


def _snapshot_caches(snapshot: dict | None) -> dict[str, dict]:
    caches = (snapshot or {}).get("caches")
    return caches if isinstance(caches, dict) else {}


def node_resident_bytes(node: Node) -> dict[str, int]:
    """Bytes per tier the node's latest heartbeat snapshot reported resident, over every cache in it."""
    totals = dict.fromkeys(TIERS, 0)
    for entry in _snapshot_caches(node.resident_snapshot).values():
        for tier in TIERS:
            totals[tier] += int(entry.get(tier, 0) or 0)
    return totals


def fleet_network_resident_bytes() -> int:
    """Bytes of the network store the live (not lost) nodes' latest snapshots report for their caches."""
    total = 0
    for snapshot in Node.objects.exclude(state=NodeState.LOST).values_list("resident_snapshot", flat=True):
        total += sum(int(entry.get("network", 0) or 0) for entry in _snapshot_caches(snapshot).values())
    return total


def node_tier_use(node: Node) -> list[TierUse]:
    """One node's capacity, reserved and resident bytes per tier, fastest tier first."""
    resident = node_resident_bytes(node)
    return [TierUse(tier, node.capacity[tier], node.reserved[tier], resident[tier]) for tier in TIERS]


def fleet_tier_use() -> list[TierUse]:
    """Capacity, reserved and resident bytes per tier summed over every node that is not lost (registering nodes
    count with their zero capacity), fastest tier first. Lost nodes count nowhere: their bytes are not available."""
    nodes = Node.objects.exclude(state=NodeState.LOST)
    totals = nodes.aggregate(
        **{f"{tier}_{kind}": Sum(f"{tier}_{kind}_bytes") for tier in TIERS for kind in ("capacity", "reserved")}
    )
    resident = dict.fromkeys(TIERS, 0)
    for node in nodes.only("id", "resident_snapshot"):
        for tier, nbytes in node_resident_bytes(node).items():
            resident[tier] += nbytes
    return [
        TierUse(tier, int(totals[f"{tier}_capacity"] or 0), int(totals[f"{tier}_reserved"] or 0), resident[tier])
        for tier in TIERS
    ]


def node_state_counts() -> dict[str, int]:
    """{state: number of nodes} for every NodeState, zero included, in the enum's order."""
    counts = dict(Node.objects.order_by().values("state").annotate(n=Count("id")).values_list("state", "n"))
    return {state: counts.get(state, 0) for state in NodeState.values}


@dataclass(frozen=True, slots=True)
class HitTotals:
    """Token hits and misses summed over the latest snapshots of live nodes; `rate` is None when nothing was read."""

    hit_tokens: int
    miss_tokens: int

    @property
    def rate(self) -> float | None:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else None


def fleet_hit_totals() -> HitTotals:
    """hit_tokens and miss_tokens of every cache entry in the latest heartbeat snapshot of each live (ready,
    draining, cordoned) node. The counters run since each cache was provisioned on its node, so the rate is over
    the caches' current placements; entries from agents that do not report them count 0."""
    hits = misses = 0
    for snapshot in Node.objects.filter(state__in=LIVE_STATES).values_list("resident_snapshot", flat=True):
        for entry in _snapshot_caches(snapshot).values():
            hits += int(entry.get("hit_tokens", 0) or 0)
            misses += int(entry.get("miss_tokens", 0) or 0)
    return HitTotals(hit_tokens=hits, miss_tokens=misses)
