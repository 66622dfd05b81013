"""Writes of the routing room: engine instances registered and deregistered (audited), their KV events applied to
the index, instances lost and found. The indexer process (routing.indexer) calls apply_batch / restart / mark_*;
the REST API the registrations."""

from __future__ import annotations

import ipaddress
import uuid
from urllib.parse import urlsplit

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import audit_record
from core.errors import ApplicationError, ConflictError, NotFoundError
from kcaas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from routing.chain import block_key
from routing.engine_load import EngineQueue
from routing.models import CacheFollow, EngineInstance, IndexedBlock, InstanceState
from tenants.models import Tenant

ENDPOINT_SCHEMES = ("tcp",)


def _engine_hash(value: int | bytes) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


def _check_host(host: str | None, what: str) -> None:
    """The indexer connects to what tenants register: an IP address inside KCAAS_ROUTING_ENGINE_NETWORKS (or
    localhost), never a name (resolved here and again at connect time, a name could point elsewhere by then)."""
    if not host:
        raise ApplicationError(f"{what} names no host.", code="invalid_endpoint")
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        raise ApplicationError(
            f"{what}: {host!r} is not an IP address (engines are registered by address).", code="invalid_endpoint"
        ) from None
    if not any(address in ipaddress.ip_network(n) for n in settings.KCAAS_ROUTING_ENGINE_NETWORKS):
        raise ApplicationError(
            f"{what}: {host!r} is outside the networks engines may be registered from.",
            code="endpoint_not_allowed",
            details={"allowed_networks": list(settings.KCAAS_ROUTING_ENGINE_NETWORKS)},
        )


def _check_zmq_endpoint(endpoint: str, what: str) -> None:
    parts = urlsplit(endpoint)
    if parts.scheme not in ENDPOINT_SCHEMES or not parts.port:
        raise ApplicationError(f"{what} must be tcp://host:port.", code="invalid_endpoint")
    _check_host(parts.hostname, what)


def instance_register(
    *,
    tenant: Tenant,
    name: str,
    model: str,
    block_size: int,
    api_base: str,
    events_endpoint: str,
    replay_endpoint: str = "",
) -> EngineInstance:
    """A new engine instance of `tenant`, live, its index empty. Raises ConflictError (name taken) or
    ApplicationError (an endpoint outside the allowed networks, or malformed)."""
    _check_host(urlsplit(api_base).hostname, "api_base")
    _check_zmq_endpoint(events_endpoint, "events_endpoint")
    if replay_endpoint:
        _check_zmq_endpoint(replay_endpoint, "replay_endpoint")
    try:
        with transaction.atomic():
            instance = EngineInstance.objects.create(
                tenant=tenant,
                name=name,
                model=model,
                block_size=block_size,
                api_base=api_base.rstrip("/"),
                events_endpoint=events_endpoint,
                replay_endpoint=replay_endpoint,
                last_healthy_at=timezone.now(),
            )
            audit_record(
                action=AuditAction.ENGINE_REGISTERED,
                target_type="engine_instance",
                target_id=instance.id,
                tenant_id=tenant.id,
                new={"name": name, "model": model, "block_size": block_size, "api_base": instance.api_base},
            )
    except IntegrityError:
        raise ConflictError(f"An engine instance named {name!r} exists.", code="name_taken") from None
    return instance


def instance_deregister(*, instance_id: uuid.UUID, tenant_id: uuid.UUID) -> None:
    """Forget one instance of the tenant and its index. Raises NotFoundError (another tenant's id included)."""
    with transaction.atomic():
        instance = EngineInstance.objects.select_for_update().filter(id=instance_id, tenant_id=tenant_id).first()
        if instance is None:
            raise NotFoundError("No such engine instance.")
        audit_record(
            action=AuditAction.ENGINE_DEREGISTERED,
            target_type="engine_instance",
            target_id=instance.id,
            tenant_id=tenant_id,
            old={"name": instance.name},
        )
        instance.delete()


def instances_forget_tenant(*, tenant_id: uuid.UUID) -> int:
    """Every instance of a tenant, every cache it followed, and their index gone (erasure); how many instances."""
    IndexedBlock.objects.filter(cache__tenant_id=tenant_id).delete()
    CacheFollow.objects.filter(cache__tenant_id=tenant_id).delete()
    count, _ = EngineInstance.objects.filter(tenant_id=tenant_id).delete()
    return count


# ---- the indexer's writes -------------------------------------------------------------------------------------------


def apply_batch(*, instance_id: uuid.UUID, seq: int, batch: EventBatch) -> bool:
    """Apply one batch to the instance's index if it is the one expected next (seq == next_seq); False if the
    instance is gone, lost or expects another seq (nothing applied then)."""
    with transaction.atomic():
        instance = EngineInstance.objects.select_for_update().filter(id=instance_id).first()
        if instance is None or instance.state != InstanceState.LIVE or seq != instance.next_seq:
            return False
        apply_batch_to({"instance": instance}, instance.block_size, instance, seq, batch)
    return True


def apply_batch_to(owner: dict, block_size: int, cursor, seq: int, batch: EventBatch) -> None:
    """In the caller's transaction, the row `cursor` locked and expecting `seq`: the batch's events to `owner`'s
    index, and the cursor moved past it (next_seq, events_applied, last_event_at)."""
    for event in batch.events:
        apply_event(owner, block_size, event)
    cursor.next_seq = seq + 1
    cursor.events_applied += len(batch.events)
    cursor.last_event_at = timezone.now()
    cursor.save(update_fields=["next_seq", "events_applied", "last_event_at"])


def apply_event(owner: dict, block_size: int, event) -> None:
    """One event to the index of `owner` ({"instance": ...} or {"cache": ...}) whose blocks hold `block_size`
    tokens."""
    if isinstance(event, BlockStored):
        _store(owner, block_size, event)
    elif isinstance(event, BlockRemoved):
        hashes = [_engine_hash(h) for h in event.block_hashes]
        IndexedBlock.objects.filter(**owner, medium=event.medium or "GPU", engine_hash__in=hashes).delete()
    elif isinstance(event, AllBlocksCleared):
        IndexedBlock.objects.filter(**owner).delete()


def _store(owner: dict, block_size: int, event: BlockStored) -> None:
    """Index the event's blocks under their content keys; blocks whose parent this index does not know (an event it
    never saw) are skipped: their keys cannot be computed, and a block that cannot be matched is never advertised."""
    if event.block_size != block_size:
        return
    parent = b""
    if event.parent_block_hash is not None:
        known = (
            IndexedBlock.objects.filter(**owner, engine_hash=_engine_hash(event.parent_block_hash))
            .values_list("block_key", flat=True)
            .first()
        )
        if known is None:
            return
        parent = bytes.fromhex(known)
    rows, size = [], event.block_size
    for i, engine_hash in enumerate(event.block_hashes):
        extras = event.extra_keys[i] if event.extra_keys else None
        parent = block_key(parent, event.token_ids[i * size : (i + 1) * size], extras)
        rows.append(
            IndexedBlock(
                **owner, medium=event.medium or "GPU", engine_hash=_engine_hash(engine_hash), block_key=parent.hex()
            )
        )
    IndexedBlock.objects.bulk_create(rows, ignore_conflicts=True)


def instance_restarted(*, instance_id: uuid.UUID) -> None:
    """The publisher started over (its seq went back to 0): what the index held of it is gone with its memory."""
    with transaction.atomic():
        IndexedBlock.objects.filter(instance_id=instance_id).delete()
        EngineInstance.objects.filter(id=instance_id).update(next_seq=0)


def gap_skipped(*, instance_id: uuid.UUID, next_seq: int) -> None:
    """Batches before `next_seq` are lost for good (no replay): counted, and the index goes on from there."""
    EngineInstance.objects.filter(id=instance_id).update(next_seq=next_seq, gaps=F("gaps") + 1)


def mark_healthy(*, instance_id: uuid.UUID, queue: EngineQueue | None = None) -> bool:
    """A health check answered: the instance is live, its queue as it reported it (None: unknown). True if it was
    lost (its index refills from its events: the indexer replays them)."""
    now = timezone.now()
    came_back = EngineInstance.objects.filter(id=instance_id, state=InstanceState.LOST).update(
        state=InstanceState.LIVE, last_healthy_at=now
    )
    queue = queue or EngineQueue(None, None)
    EngineInstance.objects.filter(id=instance_id).update(
        last_healthy_at=now, requests_waiting=queue.waiting, requests_running=queue.running
    )
    return bool(came_back)


def mark_lost(*, instance_id: uuid.UUID) -> bool:
    """Its health checks failed for KCAAS_ROUTING_STALE_SECONDS: lost, its blocks dropped (no lookup routes to it).
    True if it was live."""
    with transaction.atomic():
        updated = EngineInstance.objects.filter(id=instance_id, state=InstanceState.LIVE).update(
            state=InstanceState.LOST, next_seq=0, requests_waiting=None, requests_running=None
        )
        if updated:
            IndexedBlock.objects.filter(instance_id=instance_id).delete()
            instance = EngineInstance.objects.get(id=instance_id)
            audit_record(
                action=AuditAction.ENGINE_LOST,
                target_type="engine_instance",
                target_id=instance_id,
                tenant_id=instance.tenant_id,
                new={"state": InstanceState.LOST},
            )
    return bool(updated)
