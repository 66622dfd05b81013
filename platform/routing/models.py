"""A tenant's engine instances and the per-tenant index of the blocks each holds (docs/routing.md).

Invariants:
  * an IndexedBlock belongs to exactly one EngineInstance, and so to one tenant: every read of the index filters by
    the instance, every instance read by the tenant (nothing of one tenant's engines reaches another's lookup);
  * `block_key` names a block by content in the instance's block size: the chained digest of its tokens and those
    of every block before it, with what else the engine's hash covered (LoRA, salt, media) mixed in
    (`routing.chain.block_keys`); `engine_hash` is the engine's own hash of it, the handle its removals use;
  * an instance whose state is not `live` has no IndexedBlock (`services.mark_lost` and deregistration delete them).
"""

from __future__ import annotations

import uuid

from django.db import models


class InstanceState(models.TextChoices):
    LIVE = "live"  # publishing, or healthy and idle
    LOST = "lost"  # its health check failed for longer than KCAAS_ROUTING_STALE_SECONDS: its blocks dropped


class EngineInstance(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="engine_instances")
    name = models.CharField(max_length=63)
    model = models.CharField(max_length=256)  # as the engine serves it (OpenAI "model")
    block_size = models.PositiveIntegerField()
    api_base = models.URLField(max_length=512)  # the engine's OpenAI-compatible server, e.g. http://10.0.0.5:8000
    events_endpoint = models.CharField(max_length=256)  # its ZMQ PUB, e.g. tcp://10.0.0.5:5557
    replay_endpoint = models.CharField(max_length=256, blank=True)  # its ZMQ ROUTER for replay ("" if none)
    state = models.CharField(max_length=8, choices=InstanceState.choices, default=InstanceState.LIVE)
    next_seq = models.BigIntegerField(default=0)  # the publisher's next batch number this index expects
    events_applied = models.BigIntegerField(default=0)
    gaps = models.BigIntegerField(default=0)  # batches that could not be replayed (the index may miss blocks)
    last_event_at = models.DateTimeField(null=True, blank=True)
    last_healthy_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="engine_instance_name_per_tenant")]

    def __str__(self) -> str:
        return f"{self.name} ({self.model}, {self.state})"


class IndexedBlock(models.Model):
    instance = models.ForeignKey(EngineInstance, on_delete=models.CASCADE, related_name="blocks")
    medium = models.CharField(max_length=8)  # GPU (the engine's device memory), CPU, STORAGE
    engine_hash = models.CharField(max_length=80)  # the engine's hash, as text (int or hex bytes)
    block_key = models.CharField(max_length=32)  # routing.chain.block_keys, hex

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["instance", "medium", "engine_hash"], name="indexed_block_per_medium")
        ]
        indexes = [models.Index(fields=["instance", "block_key"], name="indexed_block_key")]
