"""The audit trail: one append-only, hash-chained table of events (and the chain's head, locked to append).

It stores tenant ids as plain values, not foreign keys: the trail imports no other room and outlives an erased
tenant. Invariants (audit.services appends; audit.chain defines the hashes):
- `seq` runs 1, 2, 3, ... without gaps; event n's prev_hash is event n-1's hash (GENESIS_HASH for n = 1);
- `hash` = chain.event_hash(prev_hash, the event's non-personal fields, `commitments`), and while `salt` is set,
  `commitments` = chain.commitments_of(salt, the event's personal fields);
- rows are never updated or deleted (PostgreSQL: a trigger refuses it, see migrations/0002), except pseudonymisation
  (audit.services.audit_pseudonymise_tenant), which may only replace personal fields and wipe the salt;
- AuditChainHead (one row, pk 1) holds the last seq and hash; an append locks it, so appends are serialized and the
  chain has no forks.
"""

from django.db import models


class AuditEvent(models.Model):
    seq = models.BigIntegerField(unique=True)
    occurred_at = models.DateTimeField(db_index=True)
    actor_kind = models.CharField(max_length=16)  # user | key | node | system
    actor_id = models.CharField(max_length=200, blank=True)
    tenant_id = models.UUIDField(null=True, blank=True, db_index=True)
    action = models.IntegerField(db_index=True)
    target_type = models.CharField(max_length=40)
    target_id = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    source_ip = models.GenericIPAddressField(null=True, blank=True)
    old_values = models.JSONField(null=True, blank=True)
    new_values = models.JSONField(null=True, blank=True)
    salt = models.BinaryField(null=True, blank=True)  # 16 bytes; None once pseudonymised
    commitments = models.JSONField()
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)
    pseudonymised_at = models.DateTimeField(null=True, blank=True)  # not hashed: when the salt was wiped

    class Meta:
        ordering = ["seq"]
        indexes = [models.Index(fields=["tenant_id", "occurred_at"], name="audit_tenant_time")]

    def chain_fields(self) -> dict:
        """The event as audit.chain hashes it (JSON-ready values)."""
        return {
            "seq": self.seq,
            "occurred_at": self.occurred_at.isoformat(),
            "actor_kind": self.actor_kind,
            "actor_id": self.actor_id,
            "tenant_id": str(self.tenant_id) if self.tenant_id else None,
            "action": self.action,
            "target_type": self.target_type,
            "target_id": self.target_id,
            "request_id": self.request_id,
            "source_ip": self.source_ip,
            "old_values": self.old_values,
            "new_values": self.new_values,
        }


class AuditChainHead(models.Model):
    """The last appended event (seq 0 / GENESIS_HASH before any)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    seq = models.BigIntegerField(default=0)
    hash = models.CharField(max_length=64)


class AuditDigest(models.Model):
    """A signed statement of the chain's head at the end of a period (audit.chain's digest body).

    Invariants: one digest per period (period_start unique); periods are contiguous (each starts where the previous
    ended); prev_digest_hash is the previous digest's digest_hash (GENESIS_HASH for the first); head_seq/head_hash
    are the last event that occurred before period_end; digest_hash and signature cover chain.digest_body(...).
    Written only by audit.digests.audit_digest_sign; never updated.
    """

    period_start = models.DateTimeField(unique=True)
    period_end = models.DateTimeField(unique=True)
    head_seq = models.BigIntegerField()
    head_hash = models.CharField(max_length=64)
    prev_digest_hash = models.CharField(max_length=64)
    digest_hash = models.CharField(max_length=64, unique=True)
    key_id = models.CharField(max_length=64)
    signature = models.CharField(max_length=128)
    signed_at = models.DateTimeField()

    class Meta:
        ordering = ["period_start"]

    def record(self) -> dict:
        """The digest as exports and the API show it (audit.chain.DIGEST_FIELDS)."""
        from audit import chain

        return {
            "period_start": chain.format_period_time(self.period_start),
            "period_end": chain.format_period_time(self.period_end),
            "head_seq": self.head_seq,
            "head_hash": self.head_hash,
            "prev_digest_hash": self.prev_digest_hash,
            "key_id": self.key_id,
            "digest_hash": self.digest_hash,
            "signature": self.signature,
        }
