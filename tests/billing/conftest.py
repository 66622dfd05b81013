"""Billing fixtures: tenants, keys, nodes and staff from the caches fixtures (real services, real PostgreSQL and
Redis), a node holding its credential, caches placed on it through caches.services, and report bodies."""

import itertools
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from rest_framework.test import APIClient

from caches import services as cache_services
from caches.models import Cache
from fleet import services as fleet_services
from fleet.models import Node
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import (  # noqa: F401 - fixtures reused
    SPEC,
    fast_password_hasher,
    make_tenant,
    purge_node_queue,
    staff_client,
    tenant_a,
    tenant_b,
)

GB = 10**9
_ports = itertools.count(9601)


class ReportingNode:
    """A registered node and an API client holding its credential."""

    def __init__(self, node: Node, credential: str):
        self.node, self.credential = node, credential
        self.boot_id = str(uuid.uuid4())
        self._sequence = itertools.count(1)

    @property
    def client(self) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {self.credential}")
        return client

    def body(self, sampled_at: datetime, entries: list[dict], *, sequence=None, boot_id=None) -> dict:
        return {
            "boot_id": boot_id or self.boot_id,
            "sequence": sequence if sequence is not None else next(self._sequence),
            "sampled_at": sampled_at.isoformat(),
            "caches": entries,
        }

    def post(self, body: dict):
        return self.client.post("/api/v1/nodes/usage", body, format="json")

    def report(self, sampled_at: datetime, entries: list[dict], **ids) -> dict:
        response = self.post(self.body(sampled_at, entries, **ids))
        assert response.status_code == 200, response.content
        return response.json()


@pytest.fixture
def make_reporting_node(db):
    made = []

    def make() -> ReportingNode:
        issued = fleet_services.node_create(name=f"bill-node-{uuid.uuid4().hex[:8]}")
        fleet_services.node_register(
            node_id=issued.node.pk,
            endpoint=f"10.2.0.1:{next(_ports)}",
            capacity={"device": 1000 * GB, "dram": 1000 * GB, "ssd": 1000 * GB},
        )
        made.append(issued.node.pk)
        return ReportingNode(Node.objects.get(pk=issued.node.pk), issued.credential)

    yield make
    for node_id in made:
        purge_node_queue(node_id)


@pytest.fixture
def reporting_node(make_reporting_node) -> ReportingNode:
    return make_reporting_node()


@pytest.fixture
def make_cache(db):
    """make_cache(tenant, node) -> a cache attached through caches.services, then placed on `node` (as a migration
    would leave it: the reservation stays where placement put it, which billing does not read)."""
    names = itertools.count(1)

    def make(tenant, node: Node):
        cache = cache_services.cache_attach(
            tenant_id=tenant.pk,
            name=f"bill-{next(names)}",
            spec=KVCacheSpec(**SPEC),
            capacity={"device": 64 * 2048, "dram": 0, "ssd": 0},
        )
        Cache.objects.filter(pk=cache.pk).update(node=node)
        return Cache.objects.get(pk=cache.pk)

    return make


def entry(cache, device=0, dram=0, ssd=0, written=0, served=0) -> dict:
    return {
        "cache_id": str(cache.pk),
        "device_bytes": device,
        "dram_bytes": dram,
        "ssd_bytes": ssd,
        "bytes_written_total": written,
        "tokens_served_total": served,
    }


def hour_floor(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def hours_ago(hours: int) -> datetime:
    """A whole UTC hour `hours` before the current one (inside the default 24 h grace for hours < 23)."""
    return hour_floor(datetime.now(UTC)) - timedelta(hours=hours)
