"""The audit trail's core: an event per call in the caller's transaction, a gap-free hash chain that verifies,
fail-closed writes, an append-only table in PostgreSQL, and pseudonymisable personal fields (commitments)."""

import uuid

import pytest
from django.db import connection, transaction

from audit import chain
from audit.actions import AuditAction
from audit.context import Actor, acting_as
from audit.models import AuditEvent
from audit.services import AuditWriteError, audit_record, sensitive_digest

pytestmark = pytest.mark.django_db(transaction=True)


def verify_rows(events) -> None:
    prev = chain.GENESIS_HASH
    for n, event in enumerate(events, start=1):
        fields = event.chain_fields()
        assert event.seq == n and event.prev_hash == prev
        assert chain.commitments_of(bytes(event.salt), fields) == event.commitments
        assert chain.event_hash(prev, fields, event.commitments) == event.hash
        prev = event.hash


def test_events_chain_and_carry_actor_and_values():
    tenant = uuid.uuid4()
    with transaction.atomic(), acting_as(Actor("key", "pub123")):
        audit_record(action=AuditAction.KEY_ISSUED, target_type="api_key", target_id="k1", tenant_id=tenant,
                     new={"scopes": ["caches:read"], "secret": "s3cr3t"}, sensitive={"secret"})  # fmt: skip
    with transaction.atomic():
        audit_record(action=AuditAction.QUOTA_UPDATED, target_type="tenant", target_id=tenant, tenant_id=tenant,
                     old={"max_caches": 5}, new={"max_caches": 7})  # fmt: skip
    events = list(AuditEvent.objects.order_by("seq"))
    verify_rows(events)
    first, second = events
    assert (first.actor_kind, first.actor_id, first.action) == ("key", "pub123", AuditAction.KEY_ISSUED)
    assert first.new_values["secret"] == sensitive_digest("s3cr3t") and "s3cr3t" not in str(first.new_values)
    assert (second.actor_kind, second.tenant_id, second.old_values) == ("system", tenant, {"max_caches": 5})


def test_the_event_rolls_back_with_the_change_and_outside_a_transaction_nothing_is_written():
    with pytest.raises(RuntimeError), transaction.atomic():
        audit_record(action=AuditAction.TENANT_CREATED, target_type="tenant", target_id="t")
        raise RuntimeError("the change failed")
    assert not AuditEvent.objects.exists()
    with pytest.raises(AuditWriteError):
        audit_record(action=AuditAction.TENANT_CREATED, target_type="tenant", target_id="t")
    with pytest.raises(AuditWriteError), transaction.atomic():
        audit_record(action=AuditAction.TENANT_CREATED, target_type="tenant", new={"x": object()})
    assert not AuditEvent.objects.exists()


def test_raw_update_delete_and_truncate_are_refused():
    with transaction.atomic():
        audit_record(action=AuditAction.TENANT_CREATED, target_type="tenant", target_id="t")
    for sql in ("UPDATE audit_auditevent SET action = 1", "DELETE FROM audit_auditevent"):
        with pytest.raises(Exception, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL kcaas.audit_allow_truncate = 'off'")
        cursor.execute("TRUNCATE audit_auditevent")
    assert AuditEvent.objects.count() == 1
