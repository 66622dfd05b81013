"""A tenant's attached caches, the data-plane tokens issued for them, and stored idempotent responses.

Invariants held by caches.services (the only writer):
- a cache holds a reservation on its node exactly while it is pending, provisioning, ready or detaching; the
  transition out of that set (to failed or detached) releases it, once, under the cache's row lock;
- non-detached caches count against the tenant's quota (failed ones too: they still hold the name and the tenant
  must detach them), and a tenant's non-detached caches have distinct names;
- `hash_key_sealed` is the per-cache block-hash key (32 random bytes) sealed with AES-256-GCM under the KEK, with
  the cache id as associated data, so a sealed key copied onto another row does not open;
- `epoch` fences the serving node: it grows whenever the cache moves, and node-facing tasks carry it.
"""

import uuid

from django.db import models
from django.db.models import Q

from kcaas.spec import ATTENTION_KINDS, KV_DTYPES, MAX_FINGERPRINT_LEN, STORAGE_DTYPES

TIERS: tuple[str, ...] = ("device", "dram", "ssd", "network")
# The tiers whose bytes a cache reserves on its node; network bytes are the fleet's store's (KCAAS_NETWORK_STORE_BYTES):
# placement never looks at them, and the store's bytes in use are the sum over the caches not detached.
NODE_TIERS: tuple[str, ...] = ("device", "dram", "ssd")


class CacheState(models.TextChoices):
    PENDING = "pending"  # row created, the node's provisioning task not yet sent
    PROVISIONING = "provisioning"  # provisioning task sent to the node's queue, no answer yet
    READY = "ready"  # the node holds the pool and serves it at `endpoint`
    FAILED = "failed"  # provisioning failed or the node was lost; see failure_reason
    DETACHING = "detaching"  # detach ordered, the node has not confirmed yet
    DETACHED = "detached"  # gone: no bytes, no reservation, no quota


# States in which the cache holds a reservation on its node.
RESERVING_STATES = (CacheState.PENDING, CacheState.PROVISIONING, CacheState.READY, CacheState.DETACHING)


class Cache(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="caches")
    name = models.CharField(max_length=63)

    # The identity/layout (kcaas.spec.KVCacheSpec), validated by it before a row is written.
    model_fingerprint = models.CharField(max_length=MAX_FINGERPRINT_LEN)
    num_layers = models.PositiveIntegerField()
    num_kv_heads = models.PositiveIntegerField()
    head_dim = models.PositiveIntegerField()
    block_size = models.PositiveIntegerField()
    kv_dtype = models.CharField(max_length=16, choices=[(d, d) for d in KV_DTYPES])
    storage_dtype = models.CharField(max_length=16, choices=[(d, d) for d in STORAGE_DTYPES])
    attention = models.CharField(max_length=8, choices=[(a, a) for a in ATTENTION_KINDS], default="mha")
    kv_lora_rank = models.PositiveIntegerField(default=0)  # mla only
    qk_rope_head_dim = models.PositiveIntegerField(default=0)  # mla only

    # Bytes reserved per tier; device is at least one block, the others 0 or at least one block.
    device_capacity_bytes = models.BigIntegerField()
    dram_capacity_bytes = models.BigIntegerField(default=0)
    ssd_capacity_bytes = models.BigIntegerField(default=0)
    # Its share of the fleet's network store (0: no network tier). Not reserved on a node: held until the cache is
    # detached (a failed cache too: one whose node was lost keeps its objects for POST .../recover).
    network_capacity_bytes = models.BigIntegerField(default=0)
    # A put is acknowledged once its full blocks are in the network store (only with network bytes).
    network_write_through = models.BooleanField(default=False)

    state = models.CharField(max_length=16, choices=CacheState.choices, default=CacheState.PENDING)
    failure_reason = models.CharField(max_length=300, blank=True, default="")
    node = models.ForeignKey("fleet.Node", null=True, blank=True, on_delete=models.PROTECT, related_name="caches")
    endpoint = models.CharField(max_length=300, blank=True, default="")  # the node's data-plane address once ready
    epoch = models.PositiveIntegerField(default=1)
    # The last time its node came back without its blocks (agent restart without them, or a pool the node no longer
    # reports): everything stored before is gone and the cache is provisioned again, empty. Null: never.
    emptied_at = models.DateTimeField(null=True, blank=True)
    hash_key_sealed = models.BinaryField()
    # The SSD tier's data key (32 bytes) sealed under the tenant key (caches.sealing.ssd_key_new_sealed); null for a
    # cache without an SSD tier. Sent in clear only inside provision_cache.
    ssd_key_sealed = models.BinaryField(null=True, blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [
            models.Index(fields=["tenant", "state"], name="caches_cache_tenant_state"),
            models.Index(fields=["node", "state"], name="caches_cache_node_state"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"], condition=~Q(state="detached"), name="caches_cache_name_unique_live"
            ),
            models.CheckConstraint(condition=Q(state__in=CacheState.values), name="caches_cache_state_valid"),
            models.CheckConstraint(condition=Q(device_capacity_bytes__gt=0), name="caches_cache_device_positive"),
            models.CheckConstraint(
                condition=Q(dram_capacity_bytes__gte=0) & Q(ssd_capacity_bytes__gte=0),
                name="caches_cache_tiers_nonneg",
            ),
            models.CheckConstraint(condition=Q(network_capacity_bytes__gte=0), name="caches_cache_network_nonneg"),
            models.CheckConstraint(
                condition=Q(network_write_through=False) | Q(network_capacity_bytes__gt=0),
                name="caches_cache_write_through_needs_network",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"

    def capacity(self) -> dict[str, int]:
        """Bytes per tier, network included (what the API shows and the node is told)."""
        return {tier: getattr(self, f"{tier}_capacity_bytes") for tier in TIERS}

    def node_capacity(self) -> dict[str, int]:
        """Bytes per node tier: what the cache reserves on its node (fleet.services.node_place / node_unreserve)."""
        return {tier: getattr(self, f"{tier}_capacity_bytes") for tier in NODE_TIERS}

    def spec_dict(self) -> dict:
        return {
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "kv_dtype": self.kv_dtype,
            "storage_dtype": self.storage_dtype,
            "attention": self.attention,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
        }


class DataToken(models.Model):
    """One issued data-plane token (the JWT itself is never stored): counts toward the outstanding quota until it
    expires or is revoked, unless the platform issued it to itself (`platform_reader`)."""

    jti = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    cache = models.ForeignKey(Cache, on_delete=models.CASCADE, related_name="data_tokens")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="data_tokens")
    access = models.CharField(max_length=16)  # "read" | "readwrite"
    issued_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    # The API key that minted it: revoking (or expiring) the key revokes the tokens it minted (caches.token_cascade).
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # A read token the control plane's indexer holds to read the cache's block events (routing.cache_follower): the
    # platform's, not the tenant's, so not in the tenant's outstanding quota; revoked with the tenant's all the same.
    platform_reader = models.BooleanField(default=False)

    class Meta:
        indexes = [models.Index(fields=["tenant", "expires_at"], name="caches_token_tenant_exp")]


class IdempotencyState(models.TextChoices):
    IN_PROGRESS = "in_progress"
    COMPLETE = "complete"


class IdempotencyRecord(models.Model):
    """An Idempotency-Key seen from a tenant: the request's fingerprint and, once done, the response to replay.

    `lock_token` fences the holder: the response is stored only by the request whose token is still on the row,
    in the same transaction as the change it describes, so a record is `complete` iff that change committed.
    """

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="idempotency_records")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)  # sha256 hex of method, path and the canonical JSON body
    state = models.CharField(max_length=16, choices=IdempotencyState.choices, default=IdempotencyState.IN_PROGRESS)
    lock_token = models.UUIDField(default=uuid.uuid4)
    locked_at = models.DateTimeField()
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "key"], name="caches_idempotency_tenant_key")]
        indexes = [models.Index(fields=["expires_at"], name="caches_idempotency_expires")]


class MigrationState(models.TextChoices):
    PENDING = "pending"  # target reserved, migrate_in sent; the target has not said it is ready
    COPYING = "copying"  # migrate_out sent: the source streams blocks while the cache still takes writes
    CUTOVER = "cutover"  # the source fenced writes (MOVED) and sends the last blocks
    COMPLETE = "complete"  # the cache is served by the target at epoch_to
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_MIGRATION_STATES = (MigrationState.PENDING, MigrationState.COPYING, MigrationState.CUTOVER)


class Migration(models.Model):
    """One move of a cache from `source` to `target` (caches.migration is the only writer).

    Invariants: at most one active (pending/copying/cutover) migration per cache; epoch_to == epoch_from + 1; while
    active the target holds a reservation of the cache's capacity, released once when it fails or is cancelled,
    and kept (as the cache's own) when it completes, the source's being released in that same transaction.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    cache = models.ForeignKey(Cache, on_delete=models.CASCADE, related_name="migrations")
    source = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="migrations_out")
    target = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="migrations_in")
    epoch_from = models.PositiveIntegerField()
    epoch_to = models.PositiveIntegerField()
    reason = models.CharField(max_length=16, choices=[(r, r) for r in ("drain", "rebalance", "replica")])
    state = models.CharField(max_length=16, choices=MigrationState.choices, default=MigrationState.PENDING)
    blocks_copied = models.BigIntegerField(default=0)
    bytes_copied = models.BigIntegerField(default=0)
    failure_reason = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["cache"],
                condition=Q(state__in=["pending", "copying", "cutover"]),
                name="caches_migration_one_active",
            ),
            models.CheckConstraint(
                condition=Q(epoch_to=models.F("epoch_from") + 1), name="caches_migration_epoch_step"
            ),
            models.CheckConstraint(condition=~Q(source=models.F("target")), name="caches_migration_moves"),
        ]
