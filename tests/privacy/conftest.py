"""Privacy fixtures: the caches room's tenants, nodes and staff client (real services, real authentication), and
checks over the audit trail's rows with audit.chain's own functions."""

import json
from datetime import UTC, datetime

import pytest

from audit import chain
from audit.exports import export_lines, export_plan
from audit.keys import platform_public_jwk
from audit.models import AuditEvent
from tests.caches.conftest import (  # noqa: F401 - fixtures re-exported for this room's tests
    fast_password_hasher,
    make_node,
    make_tenant,
    running_workers,
    staff_client,
    tenant_a,
    tenant_b,
)


@pytest.fixture
def no_grace(settings):
    """Erasures start at the first beat after the request."""
    settings.KCAAS_ERASURE_GRACE_SECONDS = 0


def audit_chain_problems() -> list[str]:
    """What the offline verifier (audit.chain.verify_export, pinned to the platform key) finds wrong in a full export
    of the trail: every event, every digest."""
    everything = export_plan(start=datetime(2000, 1, 1, tzinfo=UTC), end=datetime(2100, 1, 1, tzinfo=UTC))
    report = chain.verify_export(list(export_lines(everything, "jsonl")), trusted_key_jwk=platform_public_jwk())
    return [str(problem) for problem in report.problems]


def audit_rows_mentioning(*needles: str) -> list[int]:
    """Seqs of audit events whose any stored field contains one of `needles` (case-insensitive)."""
    found = []
    for event in AuditEvent.objects.order_by("seq"):
        text = json.dumps({**event.chain_fields(), "commitments": event.commitments}, default=str).lower()
        if any(needle.lower() in text for needle in needles):
            found.append(event.seq)
    return found
