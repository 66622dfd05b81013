"""Writes of the tenants app: tenants, API keys, quotas, key usage.

Functions are keyword-only; writes run in a transaction (``tenant_lock`` joins the caller's, and
``api_key_usage_flush`` commits one transaction per usage batch). Invariants kept here:
- a raw key is returned once (IssuedKey.raw_key) and never stored; only keys.key_hash(secret) is;
- revocation is irreversible; a key is rotated at most once (ApiKey.rotated_from is one-to-one);
- after ``api_key_rotate(overlap_seconds=s)`` the old key works until now + s (or its own earlier expiry), then it
  is refused as expired;
- quota values are integers within QUOTA_BOUNDS, or None for the default;
- ``tenant_lock`` is the serialization point of every quota check: callers hold it to the end of their transaction;
- a tenant holds at most max_api_keys usable keys when one is issued (a rotation may exceed it by its old key, for
  the overlap);
- display names (tenants, keys) are stored NFKC-normalised, without control, format or other invisible characters
  (tenants.names), and no tenant name has the TR39 skeleton of another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import audit_record
from core import keys
from core.errors import ApplicationError, ConflictError, NotFoundError, QuotaExceeded
from tenants import names, usage
from tenants import scopes as scope_rules
from tenants.models import QUOTA_FIELDS, ApiKey, KeyUsageFlush, Quota, Tenant
from tenants.redis_client import get_redis
from tenants.selectors import api_keys_usable, quota_limits

logger = logging.getLogger("kcaas.tenants")

# Inclusive bounds per quota field: sane for one tenant, and below 2**53 so every JSON client reads them exactly.
QUOTA_BOUNDS: dict[str, tuple[int, int]] = {
    "max_caches": (0, 10_000),
    "max_device_bytes": (0, 2**50),  # 1 PiB
    "max_dram_bytes": (0, 2**50),
    "max_ssd_bytes": (0, 2**52),  # 4 PiB
    "max_network_bytes": (0, 2**52),  # 4 PiB of the fleet's network store
    "max_requests_per_second": (1, 100_000),  # 0 would lock a tenant out of its own API: suspend it instead
    "max_data_tokens_outstanding": (0, 1_000_000),
    "max_api_keys": (0, 100_000),  # usable keys (neither revoked nor expired); 0: no new keys
}
MAX_OVERLAP_SECONDS = 7 * 24 * 3600
TENANT_NAME_MAX_LENGTH = names.MAX_LENGTH
KEY_NAME_MAX_LENGTH = names.MAX_LENGTH
# Display names (tenants, keys) are normalised to NFKC and may not hold control, format (bidi overrides, zero-width
# characters) or other default-ignorable characters (tenants.names); the published patterns say the same.
NAME_PATTERN = names.NAME_PATTERN
NONBLANK_NAME_PATTERN = names.NONBLANK_NAME_PATTERN
NAME_CHARACTERS_MESSAGE = names.CHARACTERS_MESSAGE
# Serializes tenant creations (PostgreSQL advisory lock, held to the end of the transaction), so two confusable
# names created at once cannot both pass the check; SQLite's transactions are serialized anyway.
_TENANT_NAMES_LOCK = 0x6B63_6E61_6D65  # "kcname"


def _display_name(field: str, name: str, *, max_length: int, allow_blank: bool) -> str:
    """`name` normalized (NFKC, stripped), or a 400 naming `field`."""
    try:
        return names.cleaned(name, max_length=max_length, allow_blank=allow_blank)
    except names.InvalidName as exc:
        raise _invalid(field, str(exc)) from None


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A newly issued key and its raw form, which is shown once and never stored."""

    api_key: ApiKey
    raw_key: str


class ValidationFailed(ApplicationError):
    code = "validation_error"


def _invalid(field: str, message: str) -> ValidationFailed:
    """The same 400 shape DRF validation gives: details.fields.<field> = [message]."""
    return ValidationFailed("The request is invalid.", details={"fields": {field: [message]}})


# ---- tenants ----------------------------------------------------------------------------------------------------


def _check_not_confusable(name: str) -> None:
    """409 ``tenant_name_confusable`` when an existing tenant's name looks like `name` (same TR39 skeleton) without
    being it (an identical name is ``tenant_name_taken``, from the unique constraint). Every name is compared: tenant
    creation is a rare staff action, and a skeleton column would be one more thing to keep in step with the table."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_TENANT_NAMES_LOCK])
    wanted = names.skeleton(name)
    for tenant_id, existing in Tenant.objects.exclude(name=name).values_list("id", "name").iterator():
        if names.skeleton(names.normalized(existing)) == wanted:
            raise ConflictError(
                f"The name looks like the existing tenant name {existing!r}.",
                code="tenant_name_confusable",
                details={
                    "fields": {"name": ["Confusable with an existing tenant name."]},
                    "confusable_with": {"id": str(tenant_id), "name": existing},
                },
            )


@transaction.atomic
def tenant_create(*, name: str, quota: dict[str, int | None] | None = None) -> Tenant:
    """A new active tenant with an all-default Quota row. The name is normalized (NFKC, stripped) and checked
    (tenants.names: 400 for a refused character); names are unique (409 ``tenant_name_taken``) and may not look like
    another tenant's (409 ``tenant_name_confusable``). ``quota``: initial overrides, as quota_update takes them, set
    in the same transaction (``quota.updated`` after ``tenant.created``); a refused value creates nothing."""
    limits = _validate_limits(quota or {})
    name = _display_name("name", name or "", max_length=TENANT_NAME_MAX_LENGTH, allow_blank=False)
    _check_not_confusable(name)
    try:
        with transaction.atomic():
            tenant = Tenant.objects.create(name=name)
    except IntegrityError:
        raise ConflictError(f"A tenant named {name!r} exists.", code="tenant_name_taken") from None
    Quota.objects.create(tenant=tenant)
    audit_record(
        action=AuditAction.TENANT_CREATED,
        target_type="tenant",
        target_id=tenant.pk,
        tenant_id=tenant.pk,
        new={"name": tenant.name, "status": tenant.status},
    )
    overrides = {field: value for field, value in limits.items() if value is not None}
    if overrides:
        quota_update(tenant=tenant, **overrides)
    return tenant


def tenant_lock(*, tenant_id) -> Tenant:
    """The tenant row locked (FOR NO KEY UPDATE: foreign-key checks never wait on it) until the caller's transaction
    ends (must be called inside one)."""
    if not connection.in_atomic_block:
        raise RuntimeError("tenant_lock must be called inside transaction.atomic()")
    tenant = Tenant.objects.select_for_update(no_key=True).filter(pk=tenant_id).first()
    if tenant is None:
        raise NotFoundError("No such tenant.")
    return tenant


_SETTABLE_STATUSES = {Tenant.Status.ACTIVE, Tenant.Status.SUSPENDED}


@transaction.atomic
def tenant_set_status(*, tenant: Tenant, status: str) -> Tenant:
    """Suspend or reactivate a tenant. Erasing/erased are owned by the privacy app and are final here."""
    if status not in _SETTABLE_STATUSES:
        raise _invalid("status", "active or suspended.")
    locked = tenant_lock(tenant_id=tenant.pk)
    if locked.status not in _SETTABLE_STATUSES:
        raise ConflictError(f"The tenant is {locked.status}.", code="tenant_inactive")
    if locked.status == status:
        return locked  # no change, no event
    old_status, locked.status = locked.status, status
    locked.save(update_fields=["status"])
    audit_record(
        action=AuditAction.TENANT_UPDATED,
        target_type="tenant",
        target_id=locked.pk,
        tenant_id=locked.pk,
        old={"status": old_status},
        new={"status": status},
    )
    return locked


# ---- API keys ----------------------------------------------------------------------------------------------------


def _check_issuable(tenant: Tenant) -> None:
    if tenant.status in (Tenant.Status.ERASING, Tenant.Status.ERASED):
        raise ConflictError(f"The tenant is {tenant.status}.", code="tenant_inactive")


def _check_key_quota(tenant: Tenant, *, replacing: ApiKey | None = None) -> None:
    """403 quota_exceeded when the tenant already holds max_api_keys usable keys (neither revoked nor expired). A
    rotation does not count the key it replaces: at the limit a key can still be rotated (the pair may then exceed
    the limit by one for the overlap), but a second rotation waits until the first's old key has expired. The
    caller holds the tenant lock."""
    limit = quota_limits(tenant=tenant).max_api_keys
    in_use = api_keys_usable(tenant_id=tenant.pk, excluding=replacing).count()
    if in_use >= limit:
        raise QuotaExceeded(
            f"The tenant may hold at most {limit} usable API keys; revoke one first.",
            details={"limit": "max_api_keys", "limit_value": limit, "in_use": in_use},
        )


@transaction.atomic
def api_key_issue(
    *, tenant: Tenant, scopes: list[str], name: str = "", expires_at: datetime | None = None
) -> IssuedKey:
    """A new key for ``tenant`` with the given scopes (validated, de-duplicated) and optional expiry (future)."""
    try:
        normalized = scope_rules.normalize_scopes(scopes)
    except scope_rules.InvalidScope as exc:
        raise _invalid("scopes", f"Unknown scope {exc.args[0]!r}.") from None
    if not normalized:
        raise _invalid("scopes", "At least one scope.")
    if expires_at is not None and expires_at <= timezone.now():
        raise _invalid("expires_at", "Must be in the future.")
    name = _display_name("name", name or "", max_length=KEY_NAME_MAX_LENGTH, allow_blank=True)
    tenant = tenant_lock(tenant_id=tenant.pk)  # the serialization point of the key quota
    _check_issuable(tenant)
    _check_key_quota(tenant)
    raw, public_id, secret = keys.generate_key(keys.TENANT_KEY_PREFIX)
    api_key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        public_id=public_id,
        secret_hash=keys.key_hash(secret),
        scopes=normalized,
        expires_at=expires_at,
    )
    audit_record(
        action=AuditAction.KEY_ISSUED,
        target_type="api_key",
        target_id=api_key.pk,
        tenant_id=tenant.pk,
        new={"public_id": public_id, "scopes": normalized},
    )  # never the secret or its hash
    return IssuedKey(api_key=api_key, raw_key=raw)


def _lock_key(api_key: ApiKey) -> ApiKey:
    return ApiKey.objects.select_for_update(no_key=True).select_related("tenant").get(pk=api_key.pk)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke now (irreversible). Revoking a revoked key is a no-op that keeps the first revocation time."""
    locked = _lock_key(api_key)
    if locked.revoked_at is None:
        locked.revoked_at = timezone.now()
        locked.save(update_fields=["revoked_at"])
        audit_record(
            action=AuditAction.KEY_REVOKED,
            target_type="api_key",
            target_id=locked.pk,
            tenant_id=locked.tenant_id,
            old={"revoked_at": None},
            new={"revoked_at": locked.revoked_at},
        )
    return locked


@transaction.atomic
def api_key_rotate(*, api_key: ApiKey, overlap_seconds: int) -> IssuedKey:
    """A successor with the same tenant, name, scopes and expiry; the old key expires after the overlap window.

    Refused (409) for a revoked, expired or already rotated key.
    """
    if isinstance(overlap_seconds, bool) or not isinstance(overlap_seconds, int):
        raise _invalid("overlap_seconds", "An integer.")
    if not 0 <= overlap_seconds <= MAX_OVERLAP_SECONDS:
        raise _invalid("overlap_seconds", f"Between 0 and {MAX_OVERLAP_SECONDS}.")
    tenant_lock(tenant_id=api_key.tenant_id)  # lock order: the tenant (the key quota's serialization point), the key
    locked = _lock_key(api_key)
    now = timezone.now()
    state = locked.state_at(now)
    if state != ApiKey.State.ACTIVE:
        raise ConflictError(f"The key is {state}.", code="api_key_inactive")
    if ApiKey.objects.filter(rotated_from=locked).exists():
        raise ConflictError("The key was already rotated.", code="api_key_already_rotated")
    _check_issuable(locked.tenant)
    _check_key_quota(locked.tenant, replacing=locked)
    raw, public_id, secret = keys.generate_key(keys.TENANT_KEY_PREFIX)
    successor = ApiKey.objects.create(
        tenant=locked.tenant,
        name=locked.name,
        public_id=public_id,
        secret_hash=keys.key_hash(secret),
        scopes=list(locked.scopes),
        expires_at=locked.expires_at,
        rotated_from=locked,
    )
    overlap_end = now + timedelta(seconds=overlap_seconds)
    old_expiry = locked.expires_at
    if locked.expires_at is None or overlap_end < locked.expires_at:
        locked.expires_at = overlap_end
        locked.save(update_fields=["expires_at"])
    audit_record(
        action=AuditAction.KEY_ROTATED,
        target_type="api_key",
        target_id=locked.pk,
        tenant_id=locked.tenant_id,
        old={"expires_at": old_expiry, "successor": None},
        new={"expires_at": locked.expires_at, "successor": successor.public_id, "successor_scopes": successor.scopes},
    )
    return IssuedKey(api_key=successor, raw_key=raw)


# ---- quotas --------------------------------------------------------------------------------------------------------


def _validate_limits(limits: dict) -> dict[str, int | None]:
    errors: dict[str, list[str]] = {}
    cleaned: dict[str, int | None] = {}
    for field, value in limits.items():
        if field not in QUOTA_BOUNDS:
            errors[field] = ["Unknown quota field."]
            continue
        low, high = QUOTA_BOUNDS[field]
        if value is None:
            cleaned[field] = None
        elif isinstance(value, bool) or not isinstance(value, int):
            errors[field] = ["An integer or null."]
        elif not low <= value <= high:
            errors[field] = [f"Between {low} and {high}."]
        else:
            cleaned[field] = value
    if errors:
        raise ValidationFailed("The request is invalid.", details={"fields": errors})
    return cleaned


@transaction.atomic
def quota_update(*, tenant: Tenant, **limits) -> Quota:
    """Set quota overrides; None resets a field to settings.KCAAS_QUOTA_DEFAULTS. Fields not given are unchanged.

    Takes the tenant lock, so a change never interleaves with a quota check in flight.
    """
    cleaned = _validate_limits(limits)
    tenant_lock(tenant_id=tenant.pk)
    quota, _ = Quota.objects.select_for_update(no_key=True).get_or_create(tenant_id=tenant.pk)
    old = {field: getattr(quota, field) for field, value in cleaned.items() if getattr(quota, field) != value}
    for field, value in cleaned.items():
        setattr(quota, field, value)
    quota.updated_at = timezone.now()
    quota.save(update_fields=[*cleaned, "updated_at"])
    if old:  # stored overrides (None: the default); an update that changes nothing writes no event
        audit_record(
            action=AuditAction.QUOTA_UPDATED,
            target_type="quota",
            target_id=tenant.pk,
            tenant_id=tenant.pk,
            old=old,
            new={field: cleaned[field] for field in old},
        )
    return quota


assert set(QUOTA_BOUNDS) == set(QUOTA_FIELDS)


# ---- key usage -----------------------------------------------------------------------------------------------------


@transaction.atomic
def api_key_usage_apply(*, batch: usage.UsageBatch) -> bool:
    """Add one claimed usage batch to the keys; False (and no change) when that batch was applied before."""
    try:
        with transaction.atomic():
            KeyUsageFlush.objects.create(batch_id=batch.batch_id, num_keys=len(batch.counts))
    except IntegrityError:
        return False
    for key_id in sorted(set(batch.counts) | set(batch.last_used)):
        updates = {"use_count": F("use_count") + batch.counts.get(key_id, 0)}
        last = batch.last_used.get(key_id)
        if last is not None:
            updates["last_used_at"] = Greatest(Coalesce("last_used_at", Value(last)), Value(last))
        ApiKey.objects.filter(pk=key_id).update(**updates)
    return True


FLUSH_RECORD_RETENTION = timedelta(days=2)


def api_key_usage_flush() -> int:
    """Move every pending usage batch from Redis to PostgreSQL; the number of batches applied. Safe to rerun."""
    client = get_redis()
    if client is None:
        return 0  # the embedded default writes usage directly
    applied = 0
    for _ in range(3):  # a pending batch left by a dead flush, then the live counters
        batch = usage.claim_batch(client)
        if batch is None:
            break
        if api_key_usage_apply(batch=batch):
            applied += 1
        usage.release_batch(client, batch.batch_id)
    KeyUsageFlush.objects.filter(flushed_at__lt=timezone.now() - FLUSH_RECORD_RETENTION).delete()
    return applied
