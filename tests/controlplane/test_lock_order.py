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
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing.services import usage_report_record
from caches import migration, services
from caches.models import Cache
from caches.reconcile import caches_reconcile_stuck
from caches.recovery import cache_recover
from fleet import services as fleet_services
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import (  # noqa: F401 - fixtures
    SPEC,
    attach_body,
    make_node,
    make_ready,
    make_tenant,
    node,
    run_in_thread,
    tenant_a,
)
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
RANK = {
    "tenants_tenant": 0,
    "caches_cache": 1,
    "caches_migration": 2,
    "fleet_node": 3,
    "fleet_nodeorder": 4,
    "audit_auditchainhead": 5,
}
LOCK = re.compile(r'FROM "(\w+)".*FOR (NO KEY UPDATE|UPDATE|SHARE|KEY SHARE)(?: OF ("?\w+"?))?', re.S)


def ready_cache(tenant, name="c1") -> Cache:
    response = tenant.client.post("/api/v1/caches", attach_body(name), format="json")
    assert response.status_code == 201, response.content
    return make_ready(response.json()["id"])


def usage_entry(cache: Cache) -> dict:
    return {
        "cache_id": cache.pk,
        "device_bytes": 4096,
        "dram_bytes": 0,
        "ssd_bytes": 0,
        "bytes_written_total": 0,
        "tokens_served_total": 0,
    }


def test_a_usage_report_commits_while_an_attach_holds_the_tenant_and_the_node(tenant_a, node):
    cache = ready_cache(tenant_a)
    holding, release = threading.Event(), threading.Event()

    def attach_and_hold():
        with transaction.atomic():
            services.cache_attach(
                tenant_id=tenant_a.tenant.pk,
                name="held",
                spec=KVCacheSpec.from_dict(SPEC),
                capacity={"device": 64 * 2048},
            )  # tenant and node rows locked
            holding.set()
            release.wait(20)

    holder = run_in_thread(attach_and_hold)
    try:
        assert holding.wait(10)
        reporter = run_in_thread(
            usage_report_record,
            node_id=node.pk,
            boot_id=uuid.uuid4(),
            sequence=1,
            sampled_at=timezone.now(),
            entries=[usage_entry(cache)],
        )
        reporter.join(5)
        assert not reporter.is_alive(), "the usage report waited for the attach's row locks"
        assert reporter.error is None, reporter.error
    finally:
        release.set()
        holder.join(20)
    assert holder.error is None, holder.error


def locks_taken(action) -> list[tuple[str, str]]:
    """(table, lock strength) of every explicit row lock `action()` takes, in order. SKIP LOCKED ones are left out:
    only the outbox's publisher takes them, in a transaction of its own after commit that locks nothing else."""
    with CaptureQueriesContext(connection) as queries:
        action()
    return [
        (m.group(1), m.group(2))
        for q in queries.captured_queries
        if (m := LOCK.search(q["sql"])) and "SKIP LOCKED" not in q["sql"]
    ]


def assert_in_order(locks: list[tuple[str, str]]) -> None:
    assert locks, "the action took no row lock: the check would prove nothing"
    assert all(strength == "NO KEY UPDATE" for _, strength in locks), locks
    ranks = [RANK[table] for table, _ in locks if table in RANK]
    assert ranks == sorted(ranks), f"row locks out of the documented order: {locks}"


def test_every_service_takes_its_row_locks_in_the_documented_order(tenant_a, make_node, node):
    spec = KVCacheSpec.from_dict(SPEC)
    assert_in_order(
        locks_taken(
            lambda: services.cache_attach(
                tenant_id=tenant_a.tenant.pk, name="a", spec=spec, capacity={"device": 64 * 2048}
            )
        )
    )
    cache = Cache.objects.get(name="a")
    assert_in_order(
        locks_taken(
            lambda: services.cache_provision_result(cache_id=cache.pk, node_id=node.pk, ok=True, endpoint="10.0.0.1:1")
        )
    )
    assert_in_order(
        locks_taken(lambda: services.data_token_issue(tenant_id=tenant_a.tenant.pk, cache_id=cache.pk, access="read"))
    )
    target = make_node()
    moving = migration.migration_start(cache_id=cache.pk, target_node_id=target.pk)
    assert_in_order(
        locks_taken(
            lambda: migration.migration_progress(migration_id=moving.pk, node_id=target.pk, phase="ready", info={})
        )
    )
    assert_in_order(locks_taken(lambda: migration.migration_result(migration_id=moving.pk, node_id=node.pk, ok=True)))
    assert Cache.objects.get(pk=cache.pk).node_id == target.pk  # the cutover happened
    assert_in_order(
        locks_taken(
            lambda: fleet_services.node_heartbeat(node_id=node.pk, capacity={"device": 8 << 30, "dram": 0, "ssd": 0})
        )
    )
    assert_in_order(locks_taken(lambda: services.cache_detach(cache_id=cache.pk, tenant_id=tenant_a.tenant.pk)))
    assert_in_order(locks_taken(lambda: services.cache_detach_result(cache_id=cache.pk, node_id=target.pk)))
    tenant_a.client.post("/api/v1/caches", attach_body("stuck"), format="json")
    assert_in_order(locks_taken(lambda: caches_reconcile_stuck(now=timezone.now() + timezone.timedelta(days=1))))
    assert Cache.objects.get(name="stuck").failure_reason == "provisioning_timeout"
    other = ready_cache(tenant_a, "b")
    assert_in_order(locks_taken(lambda: services.caches_sweep_leases(now=timezone.now() + timezone.timedelta(days=1))))
    assert Cache.objects.get(pk=other.pk).failure_reason == "node_lost"


def test_recovery_takes_its_row_locks_in_the_documented_order(tenant_a, make_node, settings):
    settings.KCAAS_NETWORK_STORE_BYTES = 1 << 30
    lost = make_node(device=64 * 2048)
    attached = services.cache_attach(
        tenant_id=tenant_a.tenant.pk,
        name="r",
        spec=KVCacheSpec.from_dict(SPEC),
        capacity={"device": 64 * 2048, "network": 64 * 2048},
    )
    assert attached.node_id == lost.pk
    make_ready(attached.pk)
    type(lost).objects.filter(pk=lost.pk).update(lease_expires_at=timezone.now() - timezone.timedelta(seconds=1))
    services.caches_sweep_leases()
    spare = make_node()
    assert_in_order(locks_taken(lambda: cache_recover(cache_id=attached.pk, tenant_id=tenant_a.tenant.pk)))
    assert Cache.objects.get(pk=attached.pk).node_id == spare.pk


# ---- several caches on several nodes: the nodes too are locked in id order, after every cache ---------------------

UUID_HEX = re.compile(r"'([0-9a-f]{32})'::uuid")


def nodes_locked_in_id_order(action) -> list[tuple[str, str]]:
    """Run `action`; assert every node row it locks by id comes after the ones it already holds in id order (the
    rows a placement chooses are locked in id order by one query and name no id). Returns its locks."""
    with CaptureQueriesContext(connection) as queries:
        action()
    held: set[str] = set()
    for query in queries.captured_queries:
        match = LOCK.search(query["sql"])
        if match is None or match.group(1) != "fleet_node" or "SKIP LOCKED" in query["sql"]:
            continue
        new = set(UUID_HEX.findall(query["sql"].split(" WHERE ", 1)[-1])) - held
        assert not held or not new or min(new) > max(held), f"node {min(new)} locked after node {max(held)}"
        held |= new
    assert len(held) >= 2, "the check needs two nodes locked"
    return [
        (m.group(1), m.group(2))
        for q in queries.captured_queries
        if (m := LOCK.search(q["sql"])) and "SKIP LOCKED" not in q["sql"]
    ]


def crossed(rows, field: str) -> None:
    """Swap `field` (a node) between two rows of one model so that the lower row id holds the higher node id: the
    order in which a service visits the rows disagrees with the nodes' id order. Both rows reserved the same."""
    low, high = sorted(rows, key=lambda row: row.pk.hex)
    if getattr(low, f"{field}_id").hex < getattr(high, f"{field}_id").hex:
        model = type(low)
        low_node, high_node = getattr(low, f"{field}_id"), getattr(high, f"{field}_id")
        model.objects.filter(pk=low.pk).update(**{field: high_node})
        model.objects.filter(pk=high.pk).update(**{field: low_node})


def caches_on_two_nodes(tenant, make_node, *, ready: bool) -> list[Cache]:
    make_node(device=64 * 2048), make_node(device=64 * 2048)  # room for one cache each
    made = []
    for name in ("x1", "x2"):
        response = tenant.client.post("/api/v1/caches", attach_body(name), format="json")
        assert response.status_code == 201, response.content
        made.append(make_ready(response.json()["id"]) if ready else Cache.objects.get(pk=response.json()["id"]))
    assert made[0].node_id != made[1].node_id
    crossed(made, "node")
    return made


def test_the_reconciler_locks_the_nodes_of_several_caches_in_id_order(tenant_a, make_node):
    caches_on_two_nodes(tenant_a, make_node, ready=False)
    assert_in_order(
        nodes_locked_in_id_order(lambda: caches_reconcile_stuck(now=timezone.now() + timezone.timedelta(days=1)))
    )
    assert set(Cache.objects.values_list("failure_reason", flat=True)) == {"provisioning_timeout"}


def test_an_erasure_locks_every_cache_before_their_nodes(tenant_a, make_node, settings):
    from privacy import services as privacy

    settings.KCAAS_ERASURE_GRACE_SECONDS = 0
    caches_on_two_nodes(tenant_a, make_node, ready=True)
    job, _ = privacy.erasure_request(tenant_id=tenant_a.tenant.pk, requested_by="system:")
    later = timezone.now() + timezone.timedelta(seconds=5)
    assert_in_order(nodes_locked_in_id_order(lambda: privacy.erasure_start(job_id=job.pk, now=later)))
    assert set(Cache.objects.values_list("state", flat=True)) == {"detached"}


def test_expiring_migrations_locks_their_target_nodes_in_id_order(tenant_a, make_node):
    from caches.models import Migration

    make_node()  # the source of both caches
    caches = [ready_cache(tenant_a, name) for name in ("m1", "m2")]
    targets = [make_node(device=64 * 2048), make_node(device=64 * 2048)]
    moves = [migration.migration_start(cache_id=c.pk, target_node_id=t.pk) for c, t in zip(caches, targets)]
    crossed(moves, "target")
    later = timezone.now() + timezone.timedelta(days=1)
    assert_in_order(nodes_locked_in_id_order(lambda: migration.migrations_expire(now=later)))
    assert set(Migration.objects.values_list("state", flat=True)) == {"failed"}


def test_a_drain_never_holds_its_node_while_it_waits_for_a_cache(tenant_a, make_node):
    """The drain's node lock is not held across the migrations it starts: a transaction holding one of the node's
    caches and then locking the node (a detach or a failed provisioning answered meanwhile) must not deadlock."""
    from caches.models import Migration

    source = make_node()
    cache = ready_cache(tenant_a, "drained")
    make_node()  # where the cache goes
    holding = threading.Event()

    def answer_while_draining():
        with transaction.atomic():
            Cache.objects.select_for_update(no_key=True).get(pk=cache.pk)
            holding.set()
            _wait_for_a_lock_waiter()  # the drain now waits for this cache
            fleet_services.node_unreserve(node_id=source.pk, capacity={"device": 0})  # the cache -> node order

    answering = run_in_thread(answer_while_draining)
    assert holding.wait(10)
    started = migration.node_drain_caches(node_id=source.pk)
    answering.join(20)
    assert answering.error is None, answering.error
    assert [m.cache_id for m in started] == [cache.pk]
    assert Migration.objects.get(cache=cache).state == "pending"


def _wait_for_a_lock_waiter(timeout: float = 10.0) -> None:
    def someone_waits() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            return bool(cursor.fetchone()[0])

    assert eventually(someone_waits, timeout=timeout), "nobody waited for the cache row"
