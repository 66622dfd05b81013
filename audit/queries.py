"""Reads of the audit trail (the API's lists). Not named `selectors`: audit/chain.py runs as a script from this
directory, where a `selectors.py` would shadow the standard library module of that name."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db.models import QuerySet

from audit.models import AuditDigest, AuditEvent


def audit_event_list(
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    tenant_id: uuid.UUID | None = None,
    actor_kind: str | None = None,
    actor_id: str | None = None,
    action: int | None = None,
) -> QuerySet[AuditEvent]:
    """Events in seq order; each filter applies when given (time range [start, end), actor kind and id)."""
    events = AuditEvent.objects.order_by("seq")
    if start is not None:
        events = events.filter(occurred_at__gte=start)
    if end is not None:
        events = events.filter(occurred_at__lt=end)
    if tenant_id is not None:
        events = events.filter(tenant_id=tenant_id)
    if actor_kind is not None:
        events = events.filter(actor_kind=actor_kind)
    if actor_id is not None:
        events = events.filter(actor_id=actor_id)
    if action is not None:
        events = events.filter(action=action)
    return events


def audit_digest_list(*, start: datetime | None = None, end: datetime | None = None) -> QuerySet[AuditDigest]:
    """Digests whose period overlaps [start, end), oldest first."""
    digests = AuditDigest.objects.order_by("period_start")
    if start is not None:
        digests = digests.filter(period_end__gt=start)
    if end is not None:
        digests = digests.filter(period_start__lt=end)
    return digests
