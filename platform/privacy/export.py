"""Data portability (GDPR Art. 20): one machine-readable JSON archive of everything the platform holds about a tenant.

Contents (format "kcaas.tenant-export", version 1): the tenant profile, its quota (overrides and effective limits),
API key metadata (never a secret or a hash), caches (identity, capacity, state, placement; never the hash key),
data-token metadata (never the token), today's usage snapshot (caches.selectors.tenant_usage), metered usage per
hour and invoices with their lines (billing.selectors.usage_series / invoices_for_tenant; `billing.available` is
false where the billing room is not installed), and the audit events about the tenant (tenant_id = the tenant).
Invariants: built from queries scoped by tenant id, so an archive never holds another tenant's rows; secrets never
appear; every export is audited (DATA_EXPORTED) in the transaction that builds it.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta

from django.apps import apps
from django.db import transaction
from django.utils import timezone

from audit.actions import AuditAction
from audit.models import AuditEvent
from audit.services import audit_record
from caches.models import Cache, DataToken
from caches.selectors import tenant_usage
from privacy.receipt import iso
from tenants.models import ApiKey, Tenant
from tenants.selectors import quota_limits, quota_overrides

EXPORT_FORMAT = "kcaas.tenant-export"
EXPORT_VERSION = 1


def _profile(tenant: Tenant) -> dict:
    return {"id": str(tenant.pk), "name": tenant.name, "status": tenant.status, "created_at": iso(tenant.created_at)}


def _quota(tenant: Tenant) -> dict:
    return {"overrides": quota_overrides(tenant=tenant), "effective": asdict(quota_limits(tenant=tenant))}


def _api_keys(tenant: Tenant) -> list[dict]:
    return [
        {
            "id": str(k.pk),
            "public_id": k.public_id,
            "name": k.name,
            "scopes": list(k.scopes),
            "state": k.state,
            "created_at": iso(k.created_at),
            "expires_at": iso(k.expires_at),
            "revoked_at": iso(k.revoked_at),
            "last_used_at": iso(k.last_used_at),
            "use_count": k.use_count,
            "rotated_from": str(k.rotated_from_id) if k.rotated_from_id else None,
        }
        for k in ApiKey.objects.filter(tenant_id=tenant.pk).order_by("created_at", "id")
    ]


def _caches(tenant: Tenant) -> list[dict]:
    return [
        {
            "id": str(c.pk),
            "name": c.name,
            "spec": c.spec_dict(),
            "capacity": c.capacity(),
            "state": c.state,
            "failure_reason": c.failure_reason,
            "node_id": str(c.node_id) if c.node_id else None,
            "endpoint": c.endpoint,
            "epoch": c.epoch,
            "created_at": iso(c.created_at),
            "updated_at": iso(c.updated_at),
        }
        for c in Cache.objects.filter(tenant_id=tenant.pk).order_by("created_at", "id")
    ]


def _data_tokens(tenant: Tenant) -> list[dict]:
    return [
        {
            "jti": str(t.jti),
            "cache_id": str(t.cache_id),
            "access": t.access,
            "issued_at": iso(t.issued_at),
            "expires_at": iso(t.expires_at),
            "revoked_at": iso(t.revoked_at),
        }
        for t in DataToken.objects.filter(tenant_id=tenant.pk).order_by("issued_at", "jti")
    ]


def _usage(tenant: Tenant) -> dict:
    snapshot = tenant_usage(tenant=tenant)
    return {
        "source": "caches.selectors.tenant_usage",
        "limits": asdict(snapshot.limits),
        "caches": {"num_caches": snapshot.caches.num_caches, "capacity_bytes": snapshot.caches.capacity_bytes},
        "data_tokens_outstanding": snapshot.data_tokens_outstanding,
        "resident_bytes": snapshot.resident_bytes,
    }


def _billing(tenant: Tenant) -> dict:
    """Metered usage (the ledger's hours) and invoices with their lines, from billing's selectors when that room is
    installed; amounts are decimal strings, never floats."""
    if not apps.is_installed("billing"):
        return {"available": False, "reason": "billing is not installed", "metered_usage": [], "invoices": []}
    from billing import selectors as billing_selectors

    series = billing_selectors.usage_series(
        tenant_id=tenant.pk,
        start=tenant.created_at - timedelta(hours=1),
        end=timezone.now() + timedelta(hours=1),
        granularity="hour",
    )
    invoices = billing_selectors.invoices_for_tenant(tenant_id=tenant.pk)
    return {
        "available": True,
        "metered_usage": [bucket.as_dict() for bucket in series],
        "invoices": [_invoice(invoice) for invoice in invoices],
    }


def _invoice(invoice) -> dict:
    lines = [
        {
            "cache_id": str(line.cache_id),
            "meter": line.meter,
            "usage": line.usage,
            "quantity": str(line.quantity),
            "unit_price": str(line.unit_price),
            "rate_effective_from": iso(line.rate_effective_from),
            "amount": str(line.amount),
        }
        for line in invoice.lines.all()
    ]
    return {
        "id": str(invoice.pk),
        "month": invoice.month.isoformat(),
        "status": invoice.status,
        "currency": invoice.currency,
        "subtotal": str(invoice.subtotal),
        "total": str(invoice.total),
        "generated_at": iso(invoice.generated_at),
        "finalised_at": iso(invoice.finalised_at),
        "lines": lines,
    }


def _audit_events(tenant: Tenant) -> list[dict]:
    events = AuditEvent.objects.filter(tenant_id=tenant.pk).order_by("seq")
    return [
        {
            "seq": e.seq,
            "occurred_at": iso(e.occurred_at),
            "action": e.action,
            "action_name": _action_name(e.action),
            "actor_kind": e.actor_kind,
            "actor_id": e.actor_id,
            "target_type": e.target_type,
            "target_id": e.target_id,
            "request_id": e.request_id,
            "source_ip": e.source_ip,
            "old_values": e.old_values,
            "new_values": e.new_values,
            "hash": e.hash,
        }
        for e in events
    ]


def _action_name(code: int) -> str:
    try:
        return AuditAction(code).code_name
    except ValueError:
        return str(code)


def tenant_export_build(*, tenant: Tenant) -> dict:
    """The archive of `tenant` (not audited: tenant_export is the audited entry point)."""
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "generated_at": iso(timezone.now()),
        "tenant": _profile(tenant),
        "quota": _quota(tenant),
        "api_keys": _api_keys(tenant),
        "caches": _caches(tenant),
        "data_tokens": _data_tokens(tenant),
        "usage": _usage(tenant),
        "billing": _billing(tenant),
        "audit_events": _audit_events(tenant),
    }


@transaction.atomic
def tenant_export(*, tenant: Tenant) -> dict:
    """Build the archive and record DATA_EXPORTED (the counts exported, never the data) in the same transaction."""
    archive = tenant_export_build(tenant=tenant)
    counts = {part: len(archive[part]) for part in ("api_keys", "caches", "data_tokens", "audit_events")}
    audit_record(
        action=AuditAction.DATA_EXPORTED,
        target_type="tenant",
        target_id=tenant.pk,
        tenant_id=tenant.pk,
        new={"format": EXPORT_FORMAT, "version": EXPORT_VERSION, **counts},
    )
    return archive
