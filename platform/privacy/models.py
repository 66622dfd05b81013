"""GDPR erasure jobs (Art. 17) and the per-node confirmations of their purges.

Invariants (privacy.services is the only writer):
- states: pending -> scheduled -> running -> complete | error | cancelled; `cancelled` only from pending/scheduled;
  `error` -> scheduled again only by a new erasure request (a retry); `complete` and `cancelled` are final;
- a tenant has at most one job that is not cancelled (partial unique index): a second request returns it;
- the tenant is named by a plain `tenant_id` value, not a foreign key: the job (and its receipt) must outlive every
  row it describes, and no delete of theirs may cascade into it;
- one ErasurePurge row per (job, node) for every node known when the job started; it goes pending -> confirmed
  once, on that node's answer, with the bytes the node freed; the job completes only when none is pending;
- `receipt` is set once, with `receipt_signature` (Ed25519 by the platform key over privacy.receipt.canonical),
  in the transaction that completes the job, and never changes afterwards.
"""

import uuid

from django.db import models
from django.db.models import Q


class ErasureState(models.TextChoices):
    PENDING = "pending"  # accepted; the grace window is being set (the same transaction schedules it)
    SCHEDULED = "scheduled"  # inside the grace window (cancellable) until scheduled_for
    RUNNING = "running"  # tenant suspended, keys and tokens revoked, purges sent; waiting for every node
    COMPLETE = "complete"  # every node confirmed, key destroyed, personal data gone, receipt signed
    ERROR = "error"  # a step failed (see `error`); a new request retries it, every step being idempotent
    CANCELLED = "cancelled"  # cancelled inside the grace window; the tenant was never touched


CANCELLABLE_STATES = (ErasureState.PENDING, ErasureState.SCHEDULED)


class ErasureJob(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant_id = models.UUIDField(db_index=True)
    state = models.CharField(max_length=16, choices=ErasureState.choices, default=ErasureState.PENDING)
    requested_by = models.CharField(max_length=200)  # "<actor kind>:<id>", e.g. "user:7"
    requested_at = models.DateTimeField()
    scheduled_for = models.DateTimeField(null=True, blank=True)  # end of the grace window
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)  # how many times the job was started
    receipt = models.JSONField(null=True, blank=True)
    receipt_key_id = models.CharField(max_length=64, blank=True, default="")
    receipt_signature = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-requested_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant_id"], condition=~Q(state="cancelled"), name="privacy_erasure_one_live_per_tenant"
            ),
            models.CheckConstraint(condition=Q(state__in=ErasureState.values), name="privacy_erasure_state_valid"),
        ]
        indexes = [models.Index(fields=["state", "scheduled_for"], name="privacy_erasure_state_due")]

    def __str__(self) -> str:
        return f"erasure {self.pk} ({self.state})"


class PurgeState(models.TextChoices):
    PENDING = "pending"
    CONFIRMED = "confirmed"


class ErasurePurge(models.Model):
    """One node's part of an erasure: kcaas.node.purge_tenant sent, privacy.purge_result received."""

    job = models.ForeignKey(ErasureJob, on_delete=models.CASCADE, related_name="purges")
    node_id = models.UUIDField()
    state = models.CharField(max_length=16, choices=PurgeState.choices, default=PurgeState.PENDING)
    send_count = models.PositiveIntegerField(default=0)
    last_sent_at = models.DateTimeField(null=True, blank=True)
    confirmed_at = models.DateTimeField(null=True, blank=True)
    freed_bytes = models.BigIntegerField(default=0)
    purged_caches = models.JSONField(default=list, blank=True)  # [{"cache_id", "freed_bytes"}] as the node said

    class Meta:
        ordering = ["node_id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "node_id"], name="privacy_purge_one_per_node"),
            models.CheckConstraint(condition=Q(freed_bytes__gte=0), name="privacy_purge_freed_nonneg"),
        ]

    def __str__(self) -> str:
        return f"purge of {self.job_id} on {self.node_id} ({self.state})"
