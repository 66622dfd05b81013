"""A tenant's engine instances, its followed caches, and the per-tenant index of the blocks each holds
(docs/routing.md).

Invariants:
  * an IndexedBlock belongs to exactly one EngineInstance or one Cache (a check constraint), and so to one tenant:
    every read of the index filters by the instance or cache, every instance or cache read by the tenant (nothing of
    one tenant's engines or caches reaches another's lookup);
  * `block_key` names a block by content in the instance's block size: the chained digest of its tokens and those
    of every block before it, with what else the engine's hash covered (LoRA, salt, media) mixed in
    (`routing.chain.block_keys`); `engine_hash` is the engine's own hash of it, the handle its removals use;
  * an instance whose state is not `live` has no IndexedBlock (`services.mark_lost` and deregistration delete them);
  * a cache has IndexedBlocks only while a CacheFollow names the node log they came from (`endpoint`, `epoch`): a
    cache that moved, restarted empty or stopped being ready loses them (`cache_index.follow_reset`).
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
    # Its queue at the last health check, as it reports it (vLLM's /metrics gauges; null: not reported)
    requests_waiting = models.IntegerField(null=True, blank=True)
    requests_running = models.IntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="engine_instance_name_per_tenant")]

    def __str__(self) -> str:
        return f"{self.name} ({self.model}, {self.state})"


class CacheFollow(models.Model):
    """Where the indexer reads a cache's block events: the node's log (its data-plane endpoint, the cache's epoch
    there) and the next batch it expects of it."""

    cache = models.OneToOneField("caches.Cache", on_delete=models.CASCADE, primary_key=True, related_name="follow")
    endpoint = models.CharField(max_length=300)
    epoch = models.PositiveIntegerField()
    next_seq = models.BigIntegerField(default=0)
    events_applied = models.BigIntegerField(default=0)
    gaps = models.BigIntegerField(default=0)  # times the node's log had dropped batches not yet read: index restarted
    last_event_at = models.DateTimeField(null=True, blank=True)


class IndexedBlock(models.Model):
    instance = models.ForeignKey(EngineInstance, null=True, on_delete=models.CASCADE, related_name="blocks")
    cache = models.ForeignKey("caches.Cache", null=True, on_delete=models.CASCADE, related_name="indexed_blocks")
    medium = models.CharField(max_length=16)  # GPU (device memory), CPU, STORAGE, NETWORK, or what a publisher names
    engine_hash = models.CharField(max_length=80)  # the engine's (or cache's) hash, as text (int or hex bytes)
    block_key = models.CharField(max_length=32)  # routing.chain.block_keys, hex

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["instance", "medium", "engine_hash"], name="indexed_block_per_medium"),
            models.UniqueConstraint(fields=["cache", "medium", "engine_hash"], name="indexed_cache_block_per_medium"),
            models.CheckConstraint(
                condition=models.Q(instance__isnull=True) ^ models.Q(cache__isnull=True), name="indexed_block_owner"
            ),
        ]
        indexes = [
            models.Index(fields=["instance", "block_key"], name="indexed_block_key"),
            models.Index(fields=["cache", "block_key"], name="indexed_cache_block_key"),
        ]
