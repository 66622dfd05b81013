"""What an erasure deletes, destroys and pseudonymises once every node has purged the tenant's blocks.

`erase_tenant_data` runs inside erasure_finish's transaction, under the tenant's row lock, and returns the facts the
receipt lists. Each part is idempotent (a retry after a rollback does it all again; after a commit it finds nothing
left to do), and keeps what the platform must keep, stripped of what identifies the tenant:
- destroyed: the tenant's data key (tenants.tenant_keys.tenant_key_destroy: crypto-shredding, so any surviving copy
  of a secret sealed under it — cache hash keys, issue 6's SSD data keys — is unreadable) and the sealed hash-key
  column of every cache row (old KEK-sealed blobs included);
- deleted: data-token rows, stored idempotent responses (they may echo names);
- pseudonymised: the tenant's name (-> "erased-<pseudonym>", status erased), API key names (-> ""), cache names
  (-> "erased"); rows are kept where other records point at them (billing, the fleet's history) or where the
  platform must keep them (key public ids: the audit trail's actors are pseudonymised separately);
- the audit trail: audit_pseudonymise_tenant with the tenant's key public ids as actor ids.
Billing records (when the billing room is installed) stay, keyed by the tenant id whose name is now a pseudonym.
"""

from __future__ import annotations

from django.apps import apps
from django.utils import timezone

from audit.services import audit_pseudonymise_tenant, tenant_pseudonym
from caches.models import Cache, DataToken, IdempotencyRecord
from privacy.receipt import iso
from tenants.models import ApiKey, Tenant
from tenants.tenant_keys import tenant_key_destroy

ERASED_CACHE_NAME = "erased"


def _erase_caches(tenant: Tenant) -> dict:
    caches = list(Cache.objects.filter(tenant_id=tenant.pk).order_by("id"))
    sealed = sum(1 for cache in caches if bytes(cache.hash_key_sealed or b""))
    Cache.objects.filter(tenant_id=tenant.pk).update(
        name=ERASED_CACHE_NAME, hash_key_sealed=b"", ssd_key_sealed=None, updated_at=timezone.now()
    )
    listed = [
        {"cache_id": str(c.pk), "node_id": str(c.node_id) if c.node_id else None, "created_at": iso(c.created_at)}
        for c in caches
    ]
    return {"caches": listed, "sealed_hash_keys_erased": sealed}


def _erase_keys(tenant: Tenant) -> tuple[list[dict], list[str], int]:
    keys = list(ApiKey.objects.filter(tenant_id=tenant.pk).order_by("created_at", "id"))
    renamed = ApiKey.objects.filter(tenant_id=tenant.pk).exclude(name="").update(name="")
    revoked = [{"public_id": k.public_id, "revoked_at": iso(k.revoked_at)} for k in keys]
    return revoked, [k.public_id for k in keys], renamed


def _billing_kept(tenant: Tenant) -> int:
    """Billing rows are kept (the platform must keep its accounts); they hold no name of their own and point at the
    tenant row, whose name is now a pseudonym. The number of invoices kept, or -1 without a billing room."""
    if not apps.is_installed("billing"):
        return -1
    from billing.selectors import invoices_for_tenant

    return invoices_for_tenant(tenant_id=tenant.pk).count()


def erase_tenant_data(*, tenant: Tenant) -> dict:
    """Destroy, delete and pseudonymise everything personal of `tenant` (locked by the caller); the receipt's facts."""
    pseudonym = tenant_pseudonym(tenant.pk)
    caches = _erase_caches(tenant)
    revoked, public_ids, keys_renamed = _erase_keys(tenant)
    data_key = tenant_key_destroy(tenant_id=tenant.pk)
    tokens_deleted, _ = DataToken.objects.filter(tenant_id=tenant.pk).delete()
    idempotency_deleted, _ = IdempotencyRecord.objects.filter(tenant_id=tenant.pk).delete()
    tenant.name, tenant.status = f"erased-{pseudonym}", Tenant.Status.ERASED
    tenant.save(update_fields=["name", "status"])
    events = audit_pseudonymise_tenant(tenant_id=tenant.pk, actor_ids=frozenset(public_ids))
    return {
        "caches": caches["caches"],
        "api_keys_revoked": revoked,
        "key_material_destroyed": [
            {"kind": "tenant_data_key", "key_id": data_key.key_id, "destroyed_at": iso(data_key.destroyed_at)},
            {"kind": "cache_hash_keys_sealed", "count": caches["sealed_hash_keys_erased"]},
        ],
        "records_deleted": {"data_tokens": tokens_deleted, "idempotency_records": idempotency_deleted},
        "records_pseudonymised": {
            "tenant_name": 1,
            "api_key_names": keys_renamed,
            "cache_names": len(caches["caches"]),
            "billing_invoices_kept": _billing_kept(tenant),
        },
        "audit_events_pseudonymised": events,
    }
