"""Tenants, their API keys and quotas.

Invariants (kept by tenants.services, the only writer):
- An ApiKey stores its public id in clear and only ``keys.key_hash(secret)`` of its secret; the raw key exists once,
  in the response that created it.
- ``revoked_at`` once set is never cleared; a key is usable iff not revoked, not past ``expires_at`` and its tenant is
  ``active``.
- A rotated key points at its predecessor through ``rotated_from``; a key has at most one successor.
- ``use_count``/``last_used_at`` are only ever increased, by the key usage flush (never on the request path).
- Quota columns are null for "the default" (settings.KCAAS_QUOTA_DEFAULTS); tenants.selectors.quota_limits merges.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"
        ERASING = "erasing"
        ERASED = "erased"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE


class ApiKey(models.Model):
    class State(models.TextChoices):
        ACTIVE = "active"
        EXPIRED = "expired"
        REVOKED = "revoked"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True, default="")
    public_id = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)  # hex HMAC-SHA256 under settings.KCAAS_KEY_PEPPER
    scopes = models.JSONField(default=list)  # sorted "resource:action" strings, see tenants.scopes
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    use_count = models.BigIntegerField(default=0)
    rotated_from = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rotated_to"
    )

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="tenants_apikey_tenant_created")]
        constraints = [models.CheckConstraint(condition=models.Q(use_count__gte=0), name="apikey_use_count_gte_0")]

    def __str__(self) -> str:
        return f"kc_live_{self.public_id}_… ({self.tenant_id})"

    def state_at(self, now) -> str:
        if self.revoked_at is not None:
            return self.State.REVOKED
        if self.expires_at is not None and self.expires_at <= now:
            return self.State.EXPIRED
        return self.State.ACTIVE

    @property
    def state(self) -> str:
        return self.state_at(timezone.now())


QUOTA_FIELDS = (
    "max_caches",
    "max_device_bytes",
    "max_dram_bytes",
    "max_ssd_bytes",
    "max_network_bytes",
    "max_requests_per_second",
    "max_data_tokens_outstanding",
    "max_api_keys",
)


class Quota(models.Model):
    tenant = models.OneToOneField(Tenant, primary_key=True, on_delete=models.CASCADE, related_name="quota")
    max_caches = models.BigIntegerField(null=True, blank=True)
    max_device_bytes = models.BigIntegerField(null=True, blank=True)
    max_dram_bytes = models.BigIntegerField(null=True, blank=True)
    max_ssd_bytes = models.BigIntegerField(null=True, blank=True)
    max_network_bytes = models.BigIntegerField(null=True, blank=True)  # its caches' share of the network store
    max_requests_per_second = models.BigIntegerField(null=True, blank=True)
    max_data_tokens_outstanding = models.BigIntegerField(null=True, blank=True)
    max_api_keys = models.BigIntegerField(null=True, blank=True)  # usable (neither revoked nor expired) keys
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(**{f"{field}__gte": 0}) | models.Q(**{f"{field}__isnull": True}),
                name=f"quota_{field}_gte_0",
            )
            for field in QUOTA_FIELDS
        ]

    def __str__(self) -> str:
        return f"quota of {self.tenant_id}"


class KeyUsageFlush(models.Model):
    """One applied batch of Redis key-usage counters: the unique batch id makes a rerun of a flush a no-op."""

    batch_id = models.UUIDField(primary_key=True)
    flushed_at = models.DateTimeField(default=timezone.now, db_index=True)
    num_keys = models.IntegerField(default=0)


class TenantKey(models.Model):
    """A tenant's data key: 32 random bytes, AES-256-GCM-wrapped under settings.KCAAS_KEK (tenants.tenant_keys).

    Invariants (tenants.tenant_keys is the only writer): one row per tenant, created lazily on first use; `key_id`
    is random, unique and named in every blob sealed under the key; `wrapped_key` is erased (set to NULL, with
    `destroyed_at`) by crypto-shredding and never set again, so every blob sealed under the key stops opening.
    """

    tenant = models.OneToOneField(Tenant, primary_key=True, on_delete=models.PROTECT, related_name="data_key")
    key_id = models.CharField(max_length=32, unique=True)
    wrapped_key = models.BinaryField(null=True, blank=True)  # version || nonce || AES-GCM(kek, key); None: destroyed
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    destroyed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"data key {self.key_id} of {self.tenant_id}{' (destroyed)' if self.destroyed_at else ''}"
