"""Writes of the audit trail. `audit_record` appends one event inside the caller's transaction (so the event
commits or rolls back with the change it describes) and raises on any failure (so the change fails with it: the
trail fails closed). Call it last in the transaction: it takes the chain head's row lock, the last lock taken.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from audit import chain
from audit.actions import AuditAction
from audit.context import Actor, current_actor, current_request
from audit.models import AuditChainHead, AuditEvent
from core.errors import TransientError
from core.metrics import timed_audit_write

SALT_BYTES = 16


class AuditWriteError(TransientError):
    """The event could not be recorded: the caller's change must not commit (answered 503 `audit_unavailable`, with
    Retry-After, by the error layer; node answers are retried)."""

    code = "audit_unavailable"
    public_message = "The audit trail is unavailable; nothing was changed. Retry later."

    def __init__(self, message: str):
        super().__init__(message)


def sensitive_digest(value: Any) -> str:
    """What the trail keeps of a sensitive value: an HMAC under the platform's audit key, never the value."""
    key = settings.KCAAS_AUDIT_HMAC_KEY.encode()
    return "hmac-sha256:" + hmac.new(key, chain.canonical(_jsonable(value)), hashlib.sha256).hexdigest()


def _jsonable(value: Any) -> Any:
    """Values the chain can hash canonically: str/int/bool/None, lists and dicts of them."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, (uuid.UUID, Decimal)):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=chain.canonical) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, float):
        return str(value)  # never hash a float: its text form is not canonical across encoders
    raise TypeError(f"cannot audit a value of type {type(value).__name__}")


def _values(values: dict | None, sensitive: frozenset[str]) -> dict | None:
    if values is None:
        return None
    return {str(k): sensitive_digest(v) if k in sensitive else _jsonable(v) for k, v in values.items()}


def _lock_head() -> AuditChainHead:
    """Lock the chain head: the last lock of the transaction. PostgreSQL checks foreign keys at COMMIT (Django makes
    them DEFERRABLE INITIALLY DEFERRED), and each check takes a KEY SHARE lock on the referenced row: left to the
    commit, that lock would come after the head's, and a transaction holding that row (say a cache being cut over)
    while waiting for the head would deadlock with us. So the deferred checks run first."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    AuditChainHead.objects.bulk_create([AuditChainHead(id=1, seq=0, hash=chain.GENESIS_HASH)], ignore_conflicts=True)
    return AuditChainHead.objects.select_for_update(no_key=True).get(pk=1)


def audit_record(
    *,
    action: AuditAction,
    target_type: str,
    target_id: Any = "",
    tenant_id: Any = None,
    old: dict | None = None,
    new: dict | None = None,
    sensitive: frozenset[str] | set[str] | tuple = (),
    actor: Actor | None = None,
) -> AuditEvent:
    """Append one event in the current transaction. `old`/`new`: the changed values (keys in `sensitive` are stored
    as HMACs). Actor, request id and source IP come from audit.context unless `actor` is given."""
    if not connection.in_atomic_block:
        raise AuditWriteError("audit_record must run inside the transaction of the change it records")
    actor = actor or current_actor()
    request = current_request()
    sensitive = frozenset(sensitive)
    with timed_audit_write():  # latency histogram; a failure is counted (core.metrics)
        try:
            head = _lock_head()
            salt = os.urandom(SALT_BYTES)
            event = AuditEvent(
                seq=head.seq + 1,
                occurred_at=timezone.now(),
                actor_kind=actor.kind,
                actor_id=str(actor.id),
                tenant_id=uuid.UUID(str(tenant_id)) if tenant_id else None,
                action=int(AuditAction(action)),
                target_type=str(target_type),
                target_id=str(target_id or ""),
                request_id=request.request_id if request else "",
                source_ip=request.source_ip if request else None,
                old_values=_values(old, sensitive),
                new_values=_values(new, sensitive),
                salt=salt,
                prev_hash=head.hash,
            )
            fields = event.chain_fields()
            event.commitments = chain.commitments_of(salt, fields)
            event.hash = chain.event_hash(head.hash, fields, event.commitments)
            with transaction.atomic():  # a savepoint: a failure here leaves the caller's transaction to roll back whole
                event.save(force_insert=True)
                head.seq, head.hash = event.seq, event.hash
                head.save(update_fields=["seq", "hash"])
        except Exception as error:
            raise AuditWriteError(f"could not record {AuditAction(action).name}: {error}") from error
    return event


def tenant_pseudonym(tenant_id: Any) -> uuid.UUID:
    """The stable pseudonym an erased tenant keeps in the trail: a UUID from an HMAC of its id under the audit key
    (the same tenant always maps to the same pseudonym; without the key it cannot be linked back)."""
    digest = hmac.new(
        settings.KCAAS_AUDIT_HMAC_KEY.encode(), b"tenant-pseudonym:" + str(tenant_id).encode(), hashlib.sha256
    ).digest()
    return uuid.UUID(bytes=digest[:16], version=4)


def audit_pseudonymise_tenant(*, tenant_id: Any, actor_ids: frozenset[str] | set[str] = frozenset()) -> int:
    """Replace the personal fields of every event about `tenant_id` (and of events whose actor is one of
    `actor_ids`, e.g. the tenant's API keys) with pseudonyms, wipe their salts, and record that it happened.
    The hashed fields do not change, so the chain still verifies; without the salts the commitments reveal nothing.
    Idempotent (already pseudonymised events are left alone). Returns how many events were changed."""
    pseudonym = tenant_pseudonym(tenant_id)
    wanted = uuid.UUID(str(tenant_id))
    now = timezone.now()
    changed = 0
    with transaction.atomic():
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET LOCAL kcaas.audit_pseudonymise = 'on'")
        events = AuditEvent.objects.select_for_update(no_key=True).filter(pseudonymised_at__isnull=True)
        events = events.filter(_about_tenant(wanted, actor_ids))
        for event in events.order_by("seq"):
            event.tenant_id = pseudonym if event.tenant_id == wanted else event.tenant_id
            if event.actor_id in actor_ids or event.actor_id == str(wanted):
                event.actor_id = f"pseudonym:{pseudonym}"
            if event.target_id == str(wanted):
                event.target_id = str(pseudonym)
            event.source_ip = None
            event.old_values = None if event.old_values is None else {"pseudonymised": True}
            event.new_values = None if event.new_values is None else {"pseudonymised": True}
            event.salt = None
            event.pseudonymised_at = now
            event.save(
                update_fields=[
                    "tenant_id",
                    "actor_id",
                    "target_id",
                    "source_ip",
                    "old_values",
                    "new_values",
                    "salt",
                    "pseudonymised_at",
                ]
            )
            changed += 1
        audit_record(
            action=AuditAction.AUDIT_PSEUDONYMISED,
            target_type="tenant",
            target_id=pseudonym,
            tenant_id=pseudonym,
            new={"events": changed},
        )
    return changed


def _about_tenant(tenant_id: uuid.UUID, actor_ids) -> Q:
    query = Q(tenant_id=tenant_id) | Q(target_id=str(tenant_id))
    if actor_ids:
        query |= Q(actor_id__in=list(actor_ids))
    return query
