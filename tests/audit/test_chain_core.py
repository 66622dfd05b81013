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
        audit_record(
            action=AuditAction.KEY_ISSUED,
            target_type="api_key",
            target_id="k1",
            tenant_id=tenant,
            new={"scopes": ["caches:read"], "secret": "s3cr3t"},
            sensitive={"secret"},
        )
    with transaction.atomic():
        audit_record(
            action=AuditAction.QUOTA_UPDATED,
            target_type="tenant",
            target_id=tenant,
            tenant_id=tenant,
            old={"max_caches": 5},
            new={"max_caches": 7},
        )
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


def test_pseudonymising_a_tenant_keeps_the_chain_and_drops_what_identified_it():
    from audit.services import audit_pseudonymise_tenant, tenant_pseudonym

    erased, kept = uuid.uuid4(), uuid.uuid4()
    with transaction.atomic(), acting_as(Actor("key", "erased-key")):
        audit_record(
            action=AuditAction.KEY_ISSUED,
            target_type="api_key",
            target_id="k1",
            tenant_id=erased,
            new={"name": "alice's key"},
        )
    with transaction.atomic():
        audit_record(
            action=AuditAction.QUOTA_UPDATED,
            target_type="tenant",
            target_id=kept,
            tenant_id=kept,
            new={"max_caches": 3},
        )
        audit_record(
            action=AuditAction.TENANT_UPDATED,
            target_type="tenant",
            target_id=erased,
            tenant_id=erased,
            old={"name": "Alice GmbH"},
            new={"status": "suspended"},
        )
    assert audit_pseudonymise_tenant(tenant_id=erased, actor_ids={"erased-key"}) == 2
    assert audit_pseudonymise_tenant(tenant_id=erased, actor_ids={"erased-key"}) == 0  # idempotent

    events = list(AuditEvent.objects.order_by("seq"))
    text = " ".join(str(e.chain_fields()) for e in events)
    assert str(erased) not in text and "Alice" not in text and "erased-key" not in text
    pseudonym = tenant_pseudonym(erased)
    assert [e.tenant_id for e in events[:3]] == [pseudonym, kept, pseudonym]
    assert events[1].salt is not None and events[1].new_values == {"max_caches": 3}  # other tenants untouched
    assert events[-1].action == AuditAction.AUDIT_PSEUDONYMISED
    prev = chain.GENESIS_HASH
    for event in events:  # every link and hash still holds; salts checked where they remain
        if event.salt is not None:
            assert chain.commitments_of(bytes(event.salt), event.chain_fields()) == event.commitments
        assert event.prev_hash == prev and chain.event_hash(prev, event.chain_fields(), event.commitments) == event.hash
        prev = event.hash


def test_a_pseudonymising_update_may_not_touch_hashed_fields():
    with transaction.atomic():
        audit_record(action=AuditAction.TENANT_CREATED, target_type="tenant", target_id="t")
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL kcaas.audit_pseudonymise = 'on'")
        cursor.execute("UPDATE audit_auditevent SET action = 1002")
