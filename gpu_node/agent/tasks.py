"""The node agent's Celery side: the tasks the control plane sends to this node's queue, and its answers.

The agent builds one Celery app of its own (no Django: configuration is the broker URL and the node's identity) and
runs a worker inside the agent process, because the pool that holds the caches must run the tasks. Handlers are
idempotent (CacheRegistry's epoch rules) and always answer, so the control plane's status guards settle the cache:
provisioning answers ok (with this node's data-plane endpoint) or failed with a machine-readable reason.
Messages: kcaas/node_protocol/messages.py, keyword arguments only: every task parses its order through its message class
(`node_task`) and every answer is built as one. A malformed order (positional arguments, a missing, unknown or
mistyped field, another version) runs nothing: an order that expects an answer and names what it is about (the
cache of provision_cache, the migration of migrate_in / migrate_out) is answered failed with the reason
`invalid_message: <what is wrong>`; any other is logged and left unanswered (a detach or purge answer would say the
work was done: the control plane's re-sends and reconcilers end those). The keys an order carries are boxes sealed
to this node's sealing key (kcaas/node_protocol/sealing.py): a key in clear, an altered box or one sealed for another
message is answered as failed (`key_not_sealed`, `sealed_key_invalid`) and provisions nothing; a box sealed to a node
key this node does not hold is not answered (the control plane re-sends the order under the key the node last
registered).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from gpu_node.agent.registry import CacheRegistry, ProvisionError
from gpu_node.dataplane.tokens import RevocationList
from kcaas.node_protocol import broker as fs_broker  # noqa: F401 - registers kcaasfs://, the embedded default's file broker
from kcaas.node_protocol.messages import (
    CONTROL_QUEUE,
    INVALID_MESSAGE,
    PROVISION_TASK,
    DetachCache,
    DetachResult,
    MessageError,
    MigrateAbort,
    MigrateIn,
    MigrateOut,
    MigrationResult,
    NodeMessage,
    ProvisionCache,
    ProvisionResult,
    PurgeResult,
    PurgeTenant,
    RevokeTokens,
)
from kcaas.node_protocol.sealing import NO_SEALING_KEY, SEALED_FOR_OTHER_KEY, NodeSealingKey, SealedKeyError
from kcaas.spec import KVCacheSpec, SpecError

logger = logging.getLogger("kcaas.node")
HASH_KEY_BYTES = 32
# How a node's unacknowledged message (its worker died mid-task) comes back on Redis. The agent's worker runs without
# an event loop, where kombu restores unacked messages only when a poll ends with no reply at all: BRPOP must then
# wait longer than the worker's 2 s drain (kombu's default of 1 s never lets that happen, and the message would be
# lost until some other consumer swept it). Visible again after 15 minutes: longer than any one node task runs.
REDIS_REDELIVERY = {"visibility_timeout": 900, "polling_interval": 5, "unacked_restore_throttle": 1}
SSD_KEY_BYTES = 32
NETWORK_WRITE_THROUGH_UNSUPPORTED = "network_write_through_unsupported"  # a node without a network store
MIGRATION_UNAVAILABLE = "migration_unavailable"  # the reason a node without a migration listener refuses a move
# How long an answer waits for the broker: about three minutes of reconnecting, at most 5 s apart.
ANSWER_RETRY_POLICY = {"max_retries": 40, "interval_start": 0.5, "interval_step": 0.5, "interval_max": 5}


class NodeKeys:
    """Opens the keys a provisioning or migration order carries, sealed to this node (kcaas/node_protocol/sealing.py:
    the task name, this node's id, the cache id and the field are the box's associated data). A key in clear is refused:
    the broker must never carry one."""

    def __init__(self, sealing_key: NodeSealingKey, node_id: str):
        self.sealing_key, self.node_id = sealing_key, str(node_id)

    def open(self, *, task: str, cache_id: str, hash_key_box, ssd_key_box="") -> tuple[bytes, bytes | None]:
        """(hash key, SSD key or None); SealedKeyError (its `reason` is the answer's) when a box does not open."""
        hash_key = self.sealing_key.open(
            hash_key_box, task=task, node_id=self.node_id, cache_id=cache_id, field="hash_key"
        )
        ssd_key = None
        if ssd_key_box:
            ssd_key = self.sealing_key.open(
                ssd_key_box, task=task, node_id=self.node_id, cache_id=cache_id, field="ssd_key"
            )
        return hash_key, ssd_key


def unsealed_keys(keys: NodeKeys | None, *, task: str, cache_id: str, hash_key_box, ssd_key_box):
    """(hash key, SSD key, None) or (None, None, reason): the reason to answer with, or None together with no keys
    when the order must not be answered at all: its boxes were sealed to a node key this node does not hold (an
    agent that restarted with a new key: the control plane sends the order again under the key the node registered
    since, or a message that was never this node's)."""
    try:
        if keys is None:
            raise SealedKeyError(NO_SEALING_KEY, "this node holds no sealing key")
        hash_key, ssd_key = keys.open(
            task=task, cache_id=str(cache_id), hash_key_box=hash_key_box, ssd_key_box=ssd_key_box
        )
    except SealedKeyError as refusal:
        if refusal.reason == SEALED_FOR_OTHER_KEY:
            logger.warning(
                "%s for cache %s: %s; not answered (it comes again under this node's key)", task, cache_id, refusal
            )
            return None, None, None
        logger.warning("%s for cache %s refused: %s", task, cache_id, refusal)
        return None, None, refusal.reason
    return hash_key, ssd_key, ""


def provision(
    registry: CacheRegistry,
    cache_id: str,
    spec: dict,
    capacity: dict,
    hash_key: bytes,
    epoch: int,
    tenant_id: str = "",
    ssd_key: bytes | None = None,
    network_write_through: bool = False,
):
    """(ok, reason) for one provisioning request with its keys already opened; never raises for a bad request (it
    is answered as failed). A cache with write-through is refused by a node without a network store
    (NETWORK_WRITE_THROUGH_UNSUPPORTED: its puts' durability could not be kept); one with network capacity alone is
    provisioned without the tier there."""
    try:
        if network_write_through and registry.network_store is None:
            return False, NETWORK_WRITE_THROUGH_UNSUPPORTED
        layout = KVCacheSpec.from_dict(spec)
        if not isinstance(hash_key, bytes) or len(hash_key) != HASH_KEY_BYTES:
            return False, "invalid_hash_key"
        if ssd_key is not None and (not isinstance(ssd_key, bytes) or len(ssd_key) != SSD_KEY_BYTES):
            return False, "invalid_ssd_key"
        registry.provision(
            cache_id=cache_id,
            spec=layout,
            capacity=capacity,
            hash_key=hash_key,
            epoch=int(epoch),
            tenant_id=tenant_id,
            ssd_key=ssd_key,
            network_write_through=bool(network_write_through),
        )
    except SpecError:
        return False, "invalid_spec"
    except (ValueError, TypeError):
        return False, "invalid_request"
    except ProvisionError as refusal:
        return False, refusal.reason
    except (MemoryError, RuntimeError, OSError) as error:  # the allocator (CUDA OOM: RuntimeError), the SSD dir
        logger.warning("provisioning %s failed: %s", cache_id, error)
        return False, "allocation_failed"
    return True, ""


def refusal_answer(
    message_class: type[NodeMessage], fields: dict[str, Any], node_id: str, error: MessageError
) -> NodeMessage | None:
    """The failure answer to a malformed order, or None when it gets none: only provision_cache, migrate_in and
    migrate_out are answered (failed, reason `invalid_message: ...`), and only when the id they are about is there
    (an answer about nothing settles nothing)."""
    reason = f"{INVALID_MESSAGE}: {error}"[:300]
    try:
        if message_class is ProvisionCache:
            return ProvisionResult(
                cache_id=fields.get("cache_id", ""), node_id=node_id, ok=False, reason=reason, endpoint=""
            )
        if message_class in (MigrateIn, MigrateOut):
            return MigrationResult(
                migration_id=fields.get("migration_id", ""), node_id=node_id, ok=False, reason=reason, info={}
            )
    except MessageError:  # the id itself is missing or malformed
        return None
    return None


def node_task(app: Celery, message_class: type[NodeMessage], answer, node_id: str):
    """Register the decorated `handler(order)` as `message_class`'s task of `app` (this app's only: several agents
    may share a process in tests). The task takes keyword arguments only and calls the handler with the parsed
    message; a malformed order is refused (refusal_answer) and the handler never runs."""

    def register(handler):
        def run(*args, **fields):
            try:
                order = message_class.from_call(args, fields)
            except MessageError as error:
                named = {**dict(zip(message_class.field_names(), args)), **fields}  # an old sender's list too
                refusal = refusal_answer(message_class, named, node_id, error)
                logger.warning(
                    "refused a malformed order (%s)", error if refusal is None else f"{error}; answered failed"
                )
                if refusal is not None:
                    answer(refusal)
                return False
            return handler(order)

        run.__name__ = run.__qualname__ = handler.__name__
        run.__doc__ = handler.__doc__
        return app.task(name=message_class.TASK, shared=False)(run)

    return register


def build_node_app(
    *,
    broker_url: str,
    node_id: str,
    endpoint: str,
    registry: CacheRegistry,
    transport_options: dict | None = None,
    revocations: RevocationList | None = None,
    migration=None,
    sealing_key: NodeSealingKey | None = None,
) -> Celery:
    """A Celery app whose tasks act on `registry` (and `revocations`, the list the data plane's TokenVerifier
    reads) and answer on the control queue as node `node_id`. `sealing_key` opens the keys in its orders (the
    key whose public half the node registered); without one every provisioning is answered `no_sealing_key`."""
    keys = NodeKeys(sealing_key, node_id) if sealing_key is not None else None
    # fixups=[]: never Celery's Django fixup, even when DJANGO_SETTINGS_MODULE happens to be set (the node agent
    # never imports Django).
    app = Celery(f"kcaas-node-{node_id}", broker=broker_url, fixups=[])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,  # a provisioning interrupted by a crash is redelivered, not lost
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    app.conf.broker_transport_options = {
        **(REDIS_REDELIVERY if broker_url.startswith(("redis", "rediss")) else {}),
        **(transport_options or {}),
    }

    def answer(message: NodeMessage) -> None:
        """Publish an answer (keyword arguments: kcaas/node_protocol/messages.py), riding out a broker outage of a few
        minutes (ANSWER_RETRY_POLICY). An answer that is lost anyway is not lost work: the control plane sends the order
        again until it is answered."""
        app.send_task(
            message.TASK, kwargs=message.to_dict(), queue=CONTROL_QUEUE, retry=True, retry_policy=ANSWER_RETRY_POLICY
        )

    @node_task(app, ProvisionCache, answer, node_id)
    def provision_cache(order: ProvisionCache) -> bool:
        hash_key, ssd_key, reason = unsealed_keys(
            keys,
            task=PROVISION_TASK,
            cache_id=order.cache_id,
            hash_key_box=order.hash_key_box,
            ssd_key_box=order.ssd_key_box,
        )
        if reason is None:
            return False  # sealed to a key this node does not hold: not answered (see unsealed_keys)
        ok = False
        if not reason:
            ok, reason = provision(
                registry,
                order.cache_id,
                order.spec,
                order.capacity,
                hash_key,
                order.epoch,
                order.tenant_id,
                ssd_key,
                network_write_through=order.network_write_through,
            )
        answer(
            ProvisionResult(
                cache_id=order.cache_id, node_id=node_id, ok=ok, reason=reason, endpoint=endpoint if ok else ""
            )
        )
        return ok

    @node_task(app, DetachCache, answer, node_id)
    def detach_cache(order: DetachCache) -> bool:
        detached = registry.detach(cache_id=order.cache_id, epoch=order.epoch, forget_network=order.forget_network)
        answer(DetachResult(cache_id=order.cache_id, node_id=node_id))
        return detached

    @node_task(app, RevokeTokens, answer, node_id)
    def revoke_tokens(order: RevokeTokens) -> int:
        return revocations.update(order.entries) if revocations is not None else 0

    @node_task(app, PurgeTenant, answer, node_id)
    def purge_tenant(order: PurgeTenant) -> int:
        purged = registry.purge_tenant(order.tenant_id)
        logger.info("purged %d caches of a tenant (job %s)", len(purged), order.job_id)
        answer(PurgeResult(job_id=order.job_id, node_id=node_id, tenant_id=order.tenant_id, purged=purged))
        return len(purged)

    if migration is not None:  # gpu_node.migration.tasks.NodeMigration: migrate_in / migrate_out / migrate_cutover
        migration.register(app, answer, keys=keys)
    else:
        _refuse_migrations(app, answer, node_id)
    return app


def _refuse_migrations(app: Celery, answer, node_id: str) -> None:
    """A node without a migration listener (KCAAS_NODE_MIGRATION_LISTEN unset) answers every migration order with a
    failure at once, so the control plane rolls the move back instead of waiting for it to stall."""

    @node_task(app, MigrateIn, answer, node_id)
    def migrate_in(order: MigrateIn) -> bool:
        answer(
            MigrationResult(
                migration_id=order.migration_id, node_id=node_id, ok=False, reason=MIGRATION_UNAVAILABLE, info={}
            )
        )
        return False

    @node_task(app, MigrateOut, answer, node_id)
    def migrate_out(order: MigrateOut) -> bool:
        answer(
            MigrationResult(
                migration_id=order.migration_id, node_id=node_id, ok=False, reason=MIGRATION_UNAVAILABLE, info={}
            )
        )
        return False

    @node_task(app, MigrateAbort, answer, node_id)
    def migrate_abort(order: MigrateAbort) -> bool:
        return False  # nothing was fenced here: this node never sends a migration
