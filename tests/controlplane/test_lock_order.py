"""One lock order across the control plane (docs/controlplane.md): tenant -> caches (id order) -> migration ->
nodes (id order) -> node orders -> the audit chain head, every explicit row lock FOR NO KEY UPDATE.

FOR NO KEY UPDATE never conflicts with the key-share locks PostgreSQL's foreign-key checks take, so a transaction
that inserts rows referencing a node, cache and tenant (a node's usage report: its checks are deferred to COMMIT and
take node, then cache and tenant) never waits for an attach or detach holding those rows — with FOR UPDATE it did,
and the two deadlocked (one answered 500). The first test is that schedule, on the real database; the second reads
the SQL of each service and checks the order of the row locks it takes."""

from __future__ import annotations

import re
import threading
import uuid

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.services import usage_report_record
from caches import migration, services
from caches.models import Cache
from caches.reconcile import caches_reconcile_stuck
from fleet import services as fleet_services
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import SPEC, attach_body, make_node, make_ready, make_tenant, node, tenant_a  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
RANK = {"tenants_tenant": 0, "caches_cache": 1, "caches_migration": 2, "fleet_node": 3, "fleet_nodeorder": 4,
        "audit_auditchainhead": 5}  # fmt: skip
LOCK = re.compile(r'FROM "(\w+)".*FOR (NO KEY UPDATE|UPDATE|SHARE|KEY SHARE)(?: OF ("?\w+"?))?', re.S)


def ready_cache(tenant, name="c1") -> Cache:
    response = tenant.client.post("/api/v1/caches", attach_body(name), format="json")
    assert response.status_code == 201, response.content
    return make_ready(response.json()["id"])


def usage_entry(cache: Cache) -> dict:
    return {"cache_id": cache.pk, "device_bytes": 4096, "dram_bytes": 0, "ssd_bytes": 0, "bytes_written_total": 0,
            "tokens_served_total": 0}  # fmt: skip


def test_a_usage_report_commits_while_an_attach_holds_the_tenant_and_the_node(tenant_a, node):
    cache = ready_cache(tenant_a)
    holding, release, outcome = threading.Event(), threading.Event(), {}

    def attach_and_hold():
        try:
            with transaction.atomic():
                services.cache_attach(tenant_id=tenant_a.tenant.pk, name="held", spec=KVCacheSpec.from_dict(SPEC),
                                      capacity={"device": 64 * 2048})  # fmt: skip - tenant and node rows locked
                holding.set()
                release.wait(20)
            outcome["attach"] = "committed"
        except Exception as error:  # noqa: BLE001 - the outcome under test
            outcome["attach"] = error
        finally:
            connections.close_all()

    holder = threading.Thread(target=attach_and_hold)
    holder.start()
    try:
        assert holding.wait(10)
        reporter = threading.Thread(target=lambda: _report(node, cache, outcome))
        reporter.start()
        reporter.join(5)
        assert outcome.get("report") == "committed", "the usage report waited for the attach's row locks"
    finally:
        release.set()
        holder.join(20)
    assert outcome["attach"] == "committed"


def _report(node, cache, outcome) -> None:
    try:
        usage_report_record(node_id=node.pk, boot_id=uuid.uuid4(), sequence=1, sampled_at=timezone.now(),
                            entries=[usage_entry(cache)])  # fmt: skip
        outcome["report"] = "committed"
    except Exception as error:  # noqa: BLE001
        outcome["report"] = error
    finally:
        connections.close_all()


def locks_taken(action) -> list[tuple[str, str]]:
    """(table, lock strength) of every explicit row lock `action()` takes, in order. SKIP LOCKED ones are left out:
    only the outbox's publisher takes them, in a transaction of its own after commit that locks nothing else."""
    with CaptureQueriesContext(connection) as queries:
        action()
    return [(m.group(1), m.group(2)) for q in queries.captured_queries
            if (m := LOCK.search(q["sql"])) and "SKIP LOCKED" not in q["sql"]]  # fmt: skip


def assert_in_order(locks: list[tuple[str, str]]) -> None:
    assert locks, "the action took no row lock: the check would prove nothing"
    assert all(strength == "NO KEY UPDATE" for _, strength in locks), locks
    ranks = [RANK[table] for table, _ in locks if table in RANK]
    assert ranks == sorted(ranks), f"row locks out of the documented order: {locks}"


def test_every_service_takes_its_row_locks_in_the_documented_order(tenant_a, make_node, node):
    spec = KVCacheSpec.from_dict(SPEC)
    assert_in_order(locks_taken(lambda: services.cache_attach(tenant_id=tenant_a.tenant.pk, name="a", spec=spec,
                                                              capacity={"device": 64 * 2048})))  # fmt: skip
    cache = Cache.objects.get(name="a")
    assert_in_order(locks_taken(lambda: services.cache_provision_result(cache_id=cache.pk, node_id=node.pk, ok=True,
                                                                        endpoint="10.0.0.1:1")))  # fmt: skip
    assert_in_order(locks_taken(lambda: services.data_token_issue(tenant_id=tenant_a.tenant.pk, cache_id=cache.pk,
                                                                  access="read")))  # fmt: skip
    target = make_node()
    moving = migration.migration_start(cache_id=cache.pk, target_node_id=target.pk)
    assert_in_order(locks_taken(lambda: migration.migration_progress(migration_id=moving.pk, node_id=target.pk,
                                                                     phase="ready", info={})))  # fmt: skip
    assert_in_order(locks_taken(lambda: migration.migration_result(migration_id=moving.pk, node_id=node.pk, ok=True)))
    assert Cache.objects.get(pk=cache.pk).node_id == target.pk  # the cutover happened
    assert_in_order(locks_taken(lambda: fleet_services.node_heartbeat(
        node_id=node.pk, capacity={"device": 8 << 30, "dram": 0, "ssd": 0})))  # fmt: skip
    assert_in_order(locks_taken(lambda: services.cache_detach(cache_id=cache.pk, tenant_id=tenant_a.tenant.pk)))
    assert_in_order(locks_taken(lambda: services.cache_detach_result(cache_id=cache.pk, node_id=target.pk)))
    tenant_a.client.post("/api/v1/caches", attach_body("stuck"), format="json")
    assert_in_order(locks_taken(lambda: caches_reconcile_stuck(now=timezone.now() + timezone.timedelta(days=1))))
    assert Cache.objects.get(name="stuck").failure_reason == "provisioning_timeout"
    other = ready_cache(tenant_a, "b")
    assert_in_order(locks_taken(lambda: services.caches_sweep_leases(now=timezone.now() + timezone.timedelta(days=1))))
    assert Cache.objects.get(pk=other.pk).failure_reason == "node_lost"
