"""The node registry: one row per node agent (one agent per GPU).

Invariants held by fleet.services (the only writer):
- capacity and reserved bytes are non-negative per tier (database check constraints);
- reserved bytes only grow through `node_place`, which adds them under a row lock after checking that they fit,
  so placement never reserves past capacity. Capacity itself is whatever the agent last reported: if a node
  reports less than is reserved, nothing is evicted here, the node simply has no free bytes on that tier;
- `credential_public_id` identifies the node credential; only an HMAC of its secret is kept (`credential_hash`);
- `sealing_public_key` is the one the agent sent in its latest registration (empty when it sent none);
- the lease is renewed by register/heartbeat; `nodes_expire_leases` turns nodes whose lease passed into `lost`,
  and only a re-register brings a lost node back to `ready`.
"""

import uuid

from django.db import models
from django.db.models import Q

TIERS: tuple[str, ...] = ("device", "dram", "ssd")  # fastest first: the order placement ranks tiers in
# What a node reports resident per cache: its own tiers and the cache's objects in the fleet's network store (which
# is no node's capacity: nodes neither have nor reserve network bytes).
RESIDENT_TIERS: tuple[str, ...] = (*TIERS, "network")


class NodeState(models.TextChoices):
    REGISTERING = "registering"  # credential issued, the agent has not registered yet
    READY = "ready"  # live lease, accepts placements
    DRAINING = "draining"  # live, no new placements, caches are being moved away
    CORDONED = "cordoned"  # live, no new placements, caches stay
    LOST = "lost"  # lease expired; its caches are flagged by the caches room


class Node(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    # "host:port" of the agent's data-plane server; empty until the agent registers.
    endpoint = models.CharField(max_length=300, blank=True, default="")
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.REGISTERING)

    device_capacity_bytes = models.BigIntegerField(default=0)
    dram_capacity_bytes = models.BigIntegerField(default=0)
    ssd_capacity_bytes = models.BigIntegerField(default=0)
    device_reserved_bytes = models.BigIntegerField(default=0)
    dram_reserved_bytes = models.BigIntegerField(default=0)
    ssd_reserved_bytes = models.BigIntegerField(default=0)

    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)  # last (re-)registration
    # Latest per-cache resident bytes reported by heartbeat: {"reported_at": iso, "caches": {id: {tier: bytes}}}.
    resident_snapshot = models.JSONField(default=dict, blank=True)

    credential_public_id = models.CharField(max_length=32, unique=True)
    credential_hash = models.CharField(max_length=64)  # hex HMAC-SHA256 of the secret with the server pepper
    # The latest certificate the platform CA issued to the node (fleet.pki): hex serial and expiry; empty/null before.
    certificate_serial = models.CharField(max_length=40, blank=True, default="")
    certificate_not_after = models.DateTimeField(null=True, blank=True)
    # The node's X25519 sealing key (base64 of 32 bytes, kcaas/node_protocol/sealing.py), sent in its authenticated
    # registration: the keys in its provisioning and migration orders are sealed to it. Empty: an agent older than key
    # sealing, which is sent no key at all (fleet.outbox.seal_for_node refuses).
    sealing_public_key = models.CharField(max_length=64, blank=True, default="")

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "lease_expires_at"], name="fleet_node_state_lease")]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=NodeState.values), name="fleet_node_state_valid"),
            # Two live nodes never answer on the same endpoint (a data-plane client routes by it).
            models.UniqueConstraint(
                fields=["endpoint"],
                condition=~Q(state=NodeState.LOST) & ~Q(endpoint=""),
                name="fleet_node_endpoint_unique_live",
            ),
            *(
                models.CheckConstraint(
                    condition=Q(**{f"{tier}_{kind}_bytes__gte": 0}), name=f"fleet_node_{tier}_{kind}_nonneg"
                )
                for tier in TIERS
                for kind in ("capacity", "reserved")
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"

    @property
    def capacity(self) -> dict[str, int]:
        return {tier: getattr(self, f"{tier}_capacity_bytes") for tier in TIERS}

    @property
    def reserved(self) -> dict[str, int]:
        return {tier: getattr(self, f"{tier}_reserved_bytes") for tier in TIERS}

    @property
    def free(self) -> dict[str, int]:
        """Unreserved bytes per tier, never negative (a node may report less capacity than is reserved)."""
        capacity, reserved = self.capacity, self.reserved
        return {tier: max(0, capacity[tier] - reserved[tier]) for tier in TIERS}


class OrderState(models.TextChoices):
    PENDING = "pending"  # written with the change it carries out; not yet accepted by the broker
    SENT = "sent"  # the broker took it; an order that expects an answer is sent again until it is acknowledged
    DONE = "done"  # acknowledged by the node's answer, accepted by the broker (no answer expected), or moot
    DROPPED = "dropped"  # its node was lost, or it outlived KCAAS_ORDER_MAX_AGE_SECONDS


OPEN_ORDER_STATES = (OrderState.PENDING, OrderState.SENT)


class NodeOrder(models.Model):
    """The transactional outbox of orders to node agents (fleet.outbox is the only writer).

    Invariants:
    - an order row is written in the same transaction as the state change it carries out, so a committed change
      always has its order and a rolled-back one never sends;
    - at most one open (pending/sent) order per (node, key): a newer order with the same key supersedes the older
      one (a cache's detach supersedes its provisioning, a re-provisioning the previous one);
    - `args` never holds a secret: it is the message's to_dict() (kcaas/node_protocol/messages.py), or, for an order
      whose
      message carries keys, the ids its `builder` (dotted path) makes the message from at send time (None once the
      order is moot); a list without a builder is a row written before messages were typed (read positionally);
    - an open order is sent until it is done: the node's handlers are idempotent (by cache id and epoch, by
      migration id), so a duplicate delivery changes nothing.
    """

    id = models.BigAutoField(primary_key=True)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="orders")
    task = models.CharField(max_length=100)
    key = models.CharField(max_length=120)  # what the order is about: "cache:<id>", "migration:<id>:in", ...
    args = models.JSONField(default=list)
    builder = models.CharField(max_length=200, blank=True, default="")
    expects_answer = models.BooleanField(default=True)
    state = models.CharField(max_length=16, choices=OrderState.choices, default=OrderState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_sent_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["state", "next_attempt_at"], name="fleet_order_due"),
            models.Index(fields=["node", "key"], name="fleet_order_node_key"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(state__in=OrderState.values), name="fleet_order_state_valid"),
            models.UniqueConstraint(
                fields=["node", "key"], condition=Q(state__in=OPEN_ORDER_STATES), name="fleet_order_one_open_per_key"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task} -> {self.node_id} ({self.state})"


class ResidentSample(models.Model):
    """One cache's resident bytes per tier and hit/miss token counters as one heartbeat of its node reported them.

    Written by fleet.samples (at most one heartbeat per node per KCAAS_SAMPLE_SECONDS is kept) and pruned after
    KCAAS_SAMPLE_RETENTION_DAYS; the console draws its time-series charts from these rows. `cache_id` names the
    cache without a foreign key (the caches room sits above fleet). The counters run since the cache was placed on
    the node (0 when the agent does not report them)."""

    id = models.BigAutoField(primary_key=True)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="resident_samples")
    cache_id = models.UUIDField()
    sampled_at = models.DateTimeField()
    device_bytes = models.BigIntegerField(default=0)
    dram_bytes = models.BigIntegerField(default=0)
    ssd_bytes = models.BigIntegerField(default=0)
    network_bytes = models.BigIntegerField(default=0)
    hit_tokens = models.BigIntegerField(default=0)
    miss_tokens = models.BigIntegerField(default=0)

    class Meta:
        indexes = [
            models.Index(fields=["sampled_at"], name="fleet_sample_at"),
            models.Index(fields=["node", "sampled_at"], name="fleet_sample_node_at"),
            models.Index(fields=["cache_id", "sampled_at"], name="fleet_sample_cache_at"),
        ]
