"""A node, a tenant and its cache with history, made through the real ingestion paths: heartbeats
(fleet.services.node_heartbeat, which stores the samples the charts read) and usage reports
(billing.services.usage_report_record, then the ledger rollup the beat runs)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone

from billing import services as billing_services
from fleet import services as fleet_services
from fleet.models import Node, NodeState
from tests.console.nodes_fixtures import GIB, attach, make_node, make_ready, make_tenant

HOURS_BACK = (3, 2, 1, 0)  # heartbeats this many hours ago, one per hour
HITS = (10, 40, 90, 160)  # cumulative hit tokens at each heartbeat
MISSES = (90, 60, 30, 40)  # cumulative miss tokens: hit rates 10 %, 40 %, 75 %, 80 %


@dataclass(frozen=True, slots=True)
class History:
    node: object
    tenant: object
    cache: object


def seed_history(*, name: str = "hist", resident_scale: int = GIB) -> History:
    """A node, tenant and ready cache with four hourly heartbeats: device bytes of 1/4 to 1 `resident_scale`, dram 1."""
    for other in Node.objects.filter(state=NodeState.READY):  # so the cache lands on this history's own node
        fleet_services.node_cordon(node_id=other.pk)
    node = make_node(f"{name}-node", device=8 * GIB, dram=16 * GIB, ssd=0)
    tenant = make_tenant(f"{name}-tenant")
    cache = make_ready(attach(tenant, f"{name}-cache", device=2 * GIB, dram=4 * GIB))
    assert cache.node_id == node.pk
    now = timezone.now().replace(microsecond=0)
    for back, hits, misses in zip(HOURS_BACK, HITS, MISSES, strict=True):
        resident = {
            "cache_id": str(cache.pk),
            "device_bytes": (back + 1) * resident_scale // 4,
            "dram_bytes": resident_scale,
            "ssd_bytes": 0,
            "hit_tokens": hits,
            "miss_tokens": misses,
        }
        fleet_services.node_heartbeat(
            node_id=node.pk, capacity=node.capacity, resident=[resident], now=now - timedelta(hours=back)
        )
    boot = uuid.uuid4()
    for sequence, minutes in enumerate((50, 20, 0), start=1):
        entry = {
            "cache_id": cache.pk,
            "device_bytes": GIB,
            "dram_bytes": 2 * GIB,
            "ssd_bytes": 0,
            "bytes_written_total": 0,
            "tokens_served_total": 0,
        }
        at = now - timedelta(minutes=minutes)
        outcome = billing_services.usage_report_record(
            node_id=node.pk, boot_id=boot, sequence=sequence, sampled_at=at, entries=[entry], now=at
        )
        assert outcome.accepted == 1, outcome
    billing_services.ledger_rollup_open_hours(now=now)
    return History(node=node, tenant=tenant, cache=cache)
