"""Issue 5, fleet room: node creation (staff), registration and re-registration (the node itself), cordon/uncordon
(staff), drain, and lease expiry (the system) each write exactly one audit event per node changed, in the change's
transaction; repeated orders, heartbeats and refused requests write none; a failed audit write rolls the change
back and answers 503 audit_unavailable."""

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from audit.actions import AuditAction
from caches import tasks as caches_tasks
from fleet import services as fleet_services
from fleet.models import Node
from tests.audit.events_support import (
    GIB,
    assert_audit_unavailable,
    assert_event,
    audit_insert_fails,
    events_since,
    iso,
    make_node,  # noqa: F401 - fixture
    mark,
    only_event_since,
    staff,  # noqa: F401 - fixture
)

pytestmark = pytest.mark.django_db

CAPACITY = {"device": 8 * GIB, "dram": 64 * GIB, "ssd": 512 * GIB}


def test_creating_a_node_is_recorded_without_its_credential(staff):
    seq = mark()
    response = staff.client.post("/api/v1/admin/nodes", {"name": "gpu-a1"}, format="json")
    assert response.status_code == 201, response.content
    node = Node.objects.get(pk=response.json()["node"]["id"])
    event = only_event_since(seq)
    assert_event(
        event,
        action=AuditAction.NODE_CREATED,
        actor=staff.actor,
        target_type="node",
        target_id=node.pk,
        tenant_id=None,
        old=None,
        new={"name": "gpu-a1", "state": "registering", "credential_public_id": node.credential_public_id},
        response=response,
    )
    secret = response.json()["credential"].rsplit("_", 1)[-1]
    assert secret not in str(event.chain_fields()) and node.credential_hash not in str(event.chain_fields())

    seq = mark()
    assert staff.client.post("/api/v1/admin/nodes", {"name": "gpu-a1"}, format="json").status_code == 409
    assert staff.client.post("/api/v1/admin/nodes", {"name": "-bad"}, format="json").status_code == 400
    assert events_since(seq) == []


def test_registration_and_re_registration_are_the_nodes_own_events(make_node):
    handle = make_node(register=False)
    seq = mark()
    response = handle.client.post(
        "/api/v1/nodes/register", {"endpoint": "10.2.0.1:9000", "capacity": CAPACITY}, format="json"
    )
    assert response.status_code == 200, response.content
    node = Node.objects.get(pk=handle.node.pk)
    assert_event(
        only_event_since(seq),
        action=AuditAction.NODE_REGISTERED,
        actor=handle.actor,
        target_type="node",
        target_id=node.pk,
        tenant_id=None,
        old={
            "state": "registering",
            "endpoint": "",
            "device_capacity_bytes": 0,
            "dram_capacity_bytes": 0,
            "ssd_capacity_bytes": 0,
            "registered_at": None,
        },
        new={
            "state": "ready",
            "endpoint": node.endpoint,
            "device_capacity_bytes": 8 * GIB,
            "dram_capacity_bytes": 64 * GIB,
            "ssd_capacity_bytes": 512 * GIB,
            "registered_at": iso(node.registered_at),
        },
        response=response,
    )

    seq = mark()  # an agent restart: same endpoint, less device memory
    again = handle.client.post(
        "/api/v1/nodes/register",
        {"endpoint": "10.2.0.1:9000", "capacity": {**CAPACITY, "device": 4 * GIB}},
        format="json",
    )
    assert again.status_code == 200
    first_registered_at = node.registered_at
    node.refresh_from_db()
    assert_event(
        only_event_since(seq),
        action=AuditAction.NODE_REGISTERED,
        actor=handle.actor,
        target_type="node",
        target_id=node.pk,
        tenant_id=None,
        old={"device_capacity_bytes": 8 * GIB, "registered_at": iso(first_registered_at)},
        new={"device_capacity_bytes": 4 * GIB, "registered_at": iso(node.registered_at)},
        response=again,
    )


def test_heartbeats_and_refused_registrations_write_nothing(make_node):
    handle, other = make_node(), make_node()
    seq = mark()
    assert handle.client.post("/api/v1/nodes/heartbeat", {"capacity": CAPACITY}, format="json").status_code == 200
    bad = handle.client.post(
        "/api/v1/nodes/register", {"endpoint": "not an endpoint", "capacity": CAPACITY}, format="json"
    )
    assert bad.status_code == 400
    taken = handle.client.post(
        "/api/v1/nodes/register", {"endpoint": other.node.endpoint, "capacity": CAPACITY}, format="json"
    )
    assert taken.status_code == 409  # endpoint_in_use
    assert events_since(seq) == []


def test_cordon_and_uncordon_are_recorded_once_each(staff, make_node):
    node = make_node().node
    base = f"/api/v1/admin/nodes/{node.pk}"
    seq = mark()
    response = staff.client.post(f"{base}/cordon")
    assert response.status_code == 200 and response.json()["state"] == "cordoned"
    assert_event(
        only_event_since(seq),
        action=AuditAction.NODE_CORDONED,
        actor=staff.actor,
        target_type="node",
        target_id=node.pk,
        tenant_id=None,
        old={"state": "ready"},
        new={"state": "cordoned"},
        response=response,
    )

    seq = mark()
    assert staff.client.post(f"{base}/cordon").status_code == 200  # already cordoned: no-op
    assert events_since(seq) == []
    response = staff.client.post(f"{base}/uncordon")
    assert response.status_code == 200
    assert_event(
        only_event_since(seq),
        action=AuditAction.NODE_UNCORDONED,
        actor=staff.actor,
        target_type="node",
        target_id=node.pk,
        tenant_id=None,
        old={"state": "cordoned"},
        new={"state": "ready"},
        response=response,
    )

    seq = mark()
    assert staff.client.post(f"{base}/uncordon").status_code == 200  # already ready: no-op
    unregistered = make_node(register=False).node
    seq = mark()
    assert staff.client.post(f"/api/v1/admin/nodes/{unregistered.pk}/cordon").status_code == 409
    assert staff.client.post("/api/v1/admin/nodes/00000000-0000-4000-8000-000000000000/cordon").status_code == 404
    assert events_since(seq) == []


def test_a_node_cannot_cordon_itself_and_that_writes_nothing(make_node):
    handle = make_node()
    seq = mark()
    assert handle.client.post(f"/api/v1/admin/nodes/{handle.node.pk}/cordon").status_code == 401  # staff only
    assert events_since(seq) == []


def test_drain_is_recorded_and_repeating_it_is_not():
    # No endpoint orders a drain yet (migration orchestration will); the service is audited as its caller.
    issued = fleet_services.node_create(name="drainee")
    fleet_services.node_register(node_id=issued.node.pk, endpoint="10.2.0.9:9000", capacity=CAPACITY)
    seq = mark()
    fleet_services.node_drain(node_id=issued.node.pk)
    assert_event(
        only_event_since(seq),
        action=AuditAction.NODE_DRAINING,
        actor=("system", ""),
        target_type="node",
        target_id=issued.node.pk,
        tenant_id=None,
        old={"state": "ready"},
        new={"state": "draining"},
    )
    seq = mark()
    fleet_services.node_drain(node_id=issued.node.pk)
    assert events_since(seq) == []


def test_the_lease_sweep_records_each_lost_node_as_the_system(make_node):
    alive, cordoned, dying = make_node(), make_node(), make_node()
    fleet_services.node_cordon(node_id=cordoned.node.pk)
    past = timezone.now() - timedelta(seconds=1)
    Node.objects.filter(pk__in=[cordoned.node.pk, dying.node.pk]).update(lease_expires_at=past)
    seq = mark()
    assert caches_tasks.sweep_leases() == 0  # the beat task: no caches to flag
    events = sorted(events_since(seq), key=lambda e: e.target_id)
    expected = sorted([(cordoned.node.pk, "cordoned"), (dying.node.pk, "ready")], key=lambda n: str(n[0]))
    assert len(events) == 2
    for event, (node_id, previous) in zip(events, expected, strict=True):
        assert_event(
            event,
            action=AuditAction.NODE_LOST,
            actor=("system", ""),
            target_type="node",
            target_id=node_id,
            tenant_id=None,
            old={"state": previous},
            new={"state": "lost"},
        )
    assert Node.objects.get(pk=alive.node.pk).state == "ready"

    seq = mark()
    assert caches_tasks.sweep_leases() == 0  # nothing new is lost
    assert events_since(seq) == []


# ---- fail closed ----------------------------------------------------------------------------------------------------


def test_a_cordon_whose_event_cannot_be_written_leaves_the_node_ready(staff, make_node):
    node = make_node().node
    seq = mark()
    with audit_insert_fails():
        assert_audit_unavailable(staff.client.post(f"/api/v1/admin/nodes/{node.pk}/cordon"))
        assert_audit_unavailable(staff.client.post("/api/v1/admin/nodes", {"name": "ghost-node"}, format="json"))
    assert Node.objects.get(pk=node.pk).state == "ready"
    assert not Node.objects.filter(name="ghost-node").exists()
    assert events_since(seq) == []


def test_a_registration_whose_event_cannot_be_written_is_refused_and_changes_nothing(make_node):
    handle = make_node(register=False)
    with audit_insert_fails():
        response = handle.client.post(
            "/api/v1/nodes/register", {"endpoint": "10.2.0.3:9000", "capacity": CAPACITY}, format="json"
        )
    assert_audit_unavailable(response)
    node = Node.objects.get(pk=handle.node.pk)
    assert (node.state, node.endpoint, node.registered_at) == ("registering", "", None)


def test_a_lease_sweep_whose_events_cannot_be_written_loses_no_node():
    issued = fleet_services.node_create(name="sweep-victim")
    fleet_services.node_register(node_id=issued.node.pk, endpoint="10.2.0.4:9000", capacity=CAPACITY)
    Node.objects.filter(pk=issued.node.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    from audit.services import AuditWriteError

    with audit_insert_fails(), pytest.raises(AuditWriteError), transaction.atomic():
        caches_tasks.sweep_leases()
    assert Node.objects.get(pk=issued.node.pk).state == "ready"  # the next sweep (with the trail back) retries
