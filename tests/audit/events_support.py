"""Shared by tests/audit/test_events_*.py: real principals (a staff user over Basic authentication, tenant API keys,
node credentials), the events written since a mark, the check of one event against the response it belongs to,
and a way to make the audit insert fail inside the test's own transaction."""

from __future__ import annotations

import base64
import contextlib
import itertools
import uuid
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from rest_framework.test import APIClient

from audit.models import AuditEvent
from fleet import services as fleet_services
from fleet.models import Node
from tenants import services as tenant_services
from tenants.models import ApiKey, Tenant

PASSWORD = "correct horse battery staple"
GIB = 2**30
CLIENT_IP = "203.0.113.7"  # sent as REMOTE_ADDR: the event must carry the caller's address
_names = itertools.count(1)
_ports = itertools.count(9501)


def client_with(authorization: str) -> APIClient:
    client = APIClient(REMOTE_ADDR=CLIENT_IP)
    client.credentials(HTTP_AUTHORIZATION=authorization)
    return client


@dataclass
class Staff:
    user: object
    client: APIClient

    @property
    def actor(self) -> tuple[str, str]:
        return ("user", str(self.user.pk))


@dataclass
class TenantKey:
    tenant: Tenant
    api_key: ApiKey
    raw_key: str
    client: APIClient

    @property
    def actor(self) -> tuple[str, str]:
        return ("key", self.api_key.public_id)


@dataclass
class NodeHandle:
    node: Node
    credential: str
    client: APIClient

    @property
    def actor(self) -> tuple[str, str]:
        return ("node", str(self.node.pk))


@pytest.fixture
def staff(db, settings) -> Staff:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # Basic auth hashes per request
    user = get_user_model().objects.create_user(f"ops-{uuid.uuid4().hex[:6]}", password=PASSWORD, is_staff=True)
    token = base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()
    return Staff(user=user, client=client_with(f"Basic {token}"))


def issue_key(tenant: Tenant, scopes) -> TenantKey:
    issued = tenant_services.api_key_issue(tenant=tenant, scopes=list(scopes))
    return TenantKey(tenant, issued.api_key, issued.raw_key, client_with(f"Bearer {issued.raw_key}"))


@pytest.fixture
def make_tenant(db):
    """make_tenant(scopes=..., **quota) -> TenantKey: a tenant and one key holding `scopes` (rate limit lifted)."""

    def make(*, scopes=("caches:read", "caches:write", "keys:read", "keys:write"), **quota) -> TenantKey:
        tenant = tenant_services.tenant_create(name=f"audited-{next(_names)}-{uuid.uuid4().hex[:6]}")
        tenant_services.quota_update(tenant=tenant, max_requests_per_second=100_000, **quota)
        return issue_key(tenant, scopes)

    return make


@pytest.fixture
def make_node(db):
    """make_node(register=True) -> NodeHandle holding the node's own credential."""

    def make(*, register: bool = True, device: int = 8 * GIB) -> NodeHandle:
        issued = fleet_services.node_create(name=f"audited-node-{next(_names)}-{uuid.uuid4().hex[:6]}")
        if register:
            fleet_services.node_register(
                node_id=issued.node.pk,
                endpoint=f"10.9.0.1:{next(_ports)}",
                capacity={"device": device, "dram": 64 * GIB, "ssd": 512 * GIB},
            )
        node = Node.objects.get(pk=issued.node.pk)
        return NodeHandle(node, issued.credential, client_with(f"Bearer {issued.credential}"))

    return make


def mark() -> int:
    """The last event's seq: events written later are the ones a call added."""
    last = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first()
    return last or 0


def events_since(seq: int) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(seq__gt=seq).order_by("seq"))


def only_event_since(seq: int) -> AuditEvent:
    events = events_since(seq)
    assert len(events) == 1, [(e.action, e.target_type) for e in events]
    return events[0]


def assert_event(
    event: AuditEvent, *, action, actor, target_type, target_id, tenant_id, old, new, response=None
) -> None:
    """The event names what happened, who did it, to what and whose, exactly the changed values, and (for a
    request) the response's request id and the caller's address."""
    assert event.action == int(action), (event.action, action)
    assert (event.actor_kind, event.actor_id) == tuple(actor)
    assert (event.target_type, event.target_id) == (target_type, str(target_id))
    assert event.tenant_id == (uuid.UUID(str(tenant_id)) if tenant_id else None)
    assert event.old_values == old
    assert event.new_values == new
    if response is not None:
        assert response["X-Request-ID"] and event.request_id == response["X-Request-ID"]
        assert event.source_ip == CLIENT_IP
    else:
        assert event.request_id == "" and event.source_ip is None


def iso(value) -> str:
    return value.isoformat()


@contextlib.contextmanager
def audit_insert_fails():
    """Inside the test's transaction, a trigger refuses every insert into the audit table (dropped on exit; the
    test's rollback would drop it anyway). Every audit_record then raises AuditWriteError."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION kcaas_test_audit_down() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'audit storage unavailable (test)'; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER kcaas_test_audit_down BEFORE INSERT ON audit_auditevent "
            "FOR EACH ROW EXECUTE FUNCTION kcaas_test_audit_down()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER kcaas_test_audit_down ON audit_auditevent")
            cursor.execute("DROP FUNCTION kcaas_test_audit_down()")


def assert_audit_unavailable(response) -> None:
    """503 in the project's error shape, machine-readable, no internals."""
    assert response.status_code == 503, (response.status_code, response.content)
    body = response.json()
    assert body["error"]["code"] == "audit_unavailable"
    assert set(body["error"]) == {"code", "message", "details"} and body["error"]["details"] == {}
    assert "test" not in body["error"]["message"] and "audit_auditevent" not in response.content.decode()
