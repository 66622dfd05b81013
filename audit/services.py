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
from django.utils import timezone

from audit import chain
from audit.actions import AuditAction
from audit.context import Actor, current_actor, current_request
from audit.models import AuditChainHead, AuditEvent

SALT_BYTES = 16


class AuditWriteError(RuntimeError):
    """The event could not be recorded: the caller's change must not commit."""


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
    AuditChainHead.objects.bulk_create([AuditChainHead(id=1, seq=0, hash=chain.GENESIS_HASH)], ignore_conflicts=True)
    return AuditChainHead.objects.select_for_update().get(pk=1)


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
    except Exception as error:  # noqa: BLE001 - fail closed: the caller's change must not commit without its event
        raise AuditWriteError(f"could not record {AuditAction(action).name}: {error}") from error
    return event
