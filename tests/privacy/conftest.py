"""Privacy fixtures: the caches room's tenants, nodes and staff client (real services, real authentication), and
checks over the audit trail's rows with audit.chain's own functions."""

import json

import pytest

from audit import chain
from audit.models import AuditEvent
from tests.caches.conftest import (  # noqa: F401 - fixtures re-exported for this room's tests
    fast_password_hasher,
    make_node,
    make_tenant,
    staff_client,
    tenant_a,
    tenant_b,
)


@pytest.fixture
def no_grace(settings):
    """Erasures start at the first beat after the request."""
    settings.KCAAS_ERASURE_GRACE_SECONDS = 0


def audit_chain_problems() -> list[str]:
    """Every break of the trail: a commitment (while the salt is kept), a hash, or a link that does not match."""
    problems, prev = [], chain.GENESIS_HASH
    for event in AuditEvent.objects.order_by("seq"):
        fields = event.chain_fields()
        if event.salt is not None and chain.commitments_of(bytes(event.salt), fields) != event.commitments:
            problems.append(f"event {event.seq}: commitments")
        if event.prev_hash != prev or chain.event_hash(prev, fields, event.commitments) != event.hash:
            problems.append(f"event {event.seq}: hash or link")
        prev = event.hash
    return problems


def audit_rows_mentioning(*needles: str) -> list[int]:
    """Seqs of audit events whose any stored field contains one of `needles` (case-insensitive)."""
    found = []
    for event in AuditEvent.objects.order_by("seq"):
        text = json.dumps({**event.chain_fields(), "commitments": event.commitments}, default=str).lower()
        if any(needle.lower() in text for needle in needles):
            found.append(event.seq)
    return found
