"""Writes of the caches app: attach/detach, the node's provisioning answers, lost nodes, data tokens.

Every function is keyword-only and transactional. Invariants kept here (see caches.models for the data's own):
- quota is checked under `tenant_lock`, so N concurrent attaches of one tenant are serialized and never pass
  max_caches or the per-tier byte limits together; the outstanding-token count is checked under the same lock;
- a cache leaves the reserving states (pending/provisioning/ready/detaching) once, under its row lock, and that
  transition releases its node reservation (`node_unreserve`) in the same transaction;
- node answers are status-guarded: only a `provisioning` cache becomes ready/failed, only a `detaching` one becomes
  detached, and only on a message from the node it is placed on; duplicates and stale deliveries change nothing;
- orders to a node go through the outbox (fleet.outbox): written in the transaction of the change, published
  after commit, sent again until the node answers (a rolled-back attach sends nothing; a broker outage delays an
  order, never loses it);
- every reserving state ends in bounded time: `caches_reconcile_stuck` fails a provisioning that outlived
  KCAAS_PROVISION_DEADLINE_SECONDS and detaches a detach the node never confirmed within
  KCAAS_DETACH_DEADLINE_SECONDS, releasing the reservation either way.

Lock order (docs/controlplane.md): tenant -> caches (id order) -> migration -> nodes (id order) -> node orders ->
the audit chain head. Row locks are FOR NO KEY UPDATE, which never conflict with the key-share locks that foreign-key
checks take, so inserting a row that references a locked tenant, cache or node never waits for it.
"""

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from audit.actions import AuditAction
from audit.context import SYSTEM
from audit.services import audit_record
from caches import selectors
from caches.errors import CacheNameTaken, CacheNotReady, InvalidCapacity
from caches.models import NODE_TIERS, RESERVING_STATES, TIERS, Cache, CacheState, DataToken
from caches.network_store import network_store_reserve, write_through_check
from caches.sealing import SealError, hash_key_new_sealed, hash_key_unseal, ssd_key_new_sealed, ssd_key_unseal
from caches.signing import token_sign
from core.errors import ConflictError, NotFoundError, QuotaExceeded
from core.ids import as_uuid
from core.metrics import CACHE_ATTACHES, counted_outcome
from fleet.models import NodeState
from fleet.outbox import order_enqueue, orders_acknowledge, seal_for_node
from fleet.services import node_place, node_unreserve, nodes_expire_unrecorded, nodes_lock, nodes_lost_record
from kcaas.node_protocol.messages import DETACH_TASK, PROVISION_TASK, DetachCache, ProvisionCache, RevokeTokens
from kcaas.spec import KVCacheSpec
from tenants.models import Tenant
from tenants.selectors import quota_limits
from tenants.services import tenant_lock

logger = logging.getLogger("kcaas.caches")

MAX_TIER_BYTES = 2**50  # 1 PiB per tier per cache: far above any node, far below integer overflow
MAX_REASON_LENGTH = 300
NODE_LOST = "node_lost"
PROVISIONING_TIMEOUT = "provisioning_timeout"
NODE_SEALING_KEY_MISSING = "node_sealing_key_missing"  # its node registered no sealing key: no keys could be sent
DETACH_UNCONFIRMED = "detach_unconfirmed"
ACCESS_LEVELS = ("read", "readwrite")
MIN_TOKEN_TTL_SECONDS = 60


def cache_key(cache_id) -> str:
    """The outbox key of a cache's provisioning and detach orders on a node: a detach supersedes a provisioning."""
    return f"cache:{cache_id}"


def _order_detach(cache: Cache, node_id=None, *, forget_network: bool = False) -> None:
    """Tell the node (default: the cache's) to drop the cache's pool at its epoch, until it confirms; with
    `forget_network` (the tenant detaches it for good) its network objects too, else they stay for its next node."""
    message = DetachCache(cache_id=str(cache.pk), epoch=cache.epoch, forget_network=forget_network)
    order_enqueue(node_id=node_id or cache.node_id, message=message, key=cache_key(cache.pk))


# ---- attach ----------------------------------------------------------------------------------------------------------


def capacity_check(*, spec: KVCacheSpec, capacity: dict[str, int]) -> dict[str, int]:
    """A full {tier: bytes} mapping: device at least one whole block, dram/ssd/network 0 or at least one block, each
    at most MAX_TIER_BYTES. InvalidCapacity (400, details per tier) otherwise."""
    unknown = sorted(set(capacity) - set(TIERS))
    full = {tier: capacity.get(tier, 0) for tier in TIERS}
    problems: dict[str, list[str]] = {tier: [f"unknown tier (tiers: {', '.join(TIERS)})"] for tier in unknown}
    for tier, nbytes in full.items():
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            problems[tier] = ["must be an integer number of bytes"]
        elif nbytes > MAX_TIER_BYTES:
            problems[tier] = [f"must be at most {MAX_TIER_BYTES} bytes"]
        elif (tier == "device" or nbytes != 0) and nbytes < spec.block_bytes:
            zero = "" if tier == "device" else "0 or "
            problems[tier] = [f"must be {zero}at least one block ({spec.block_bytes} bytes for this layout)"]
    if problems:
        raise InvalidCapacity(
            "The capacity is invalid for this layout.",
            details={"fields": {"capacity": problems}, "block_bytes": spec.block_bytes},
        )
    return full


def _check_quota(*, tenant: Tenant, capacity: dict[str, int]) -> None:
    limits = quota_limits(tenant=tenant)
    usage = selectors.cache_usage(tenant_id=tenant.pk)
    if usage.num_caches + 1 > limits.max_caches:
        raise QuotaExceeded(
            f"The tenant may hold at most {limits.max_caches} caches.",
            details={"limit": "max_caches", "limit_value": limits.max_caches, "in_use": usage.num_caches},
        )
    for tier, limit in limits.capacity_bytes().items():
        in_use = usage.capacity_bytes[tier]
        if in_use + capacity[tier] > limit:
            raise QuotaExceeded(
                f"The tenant's caches may hold at most {limit} {tier} bytes.",
                details={
                    "limit": f"max_{tier}_bytes",
                    "limit_value": limit,
                    "in_use": in_use,
                    "requested": capacity[tier],
                },
            )


@transaction.atomic
def cache_attach(
    *,
    tenant_id: uuid.UUID,
    name: str,
    spec: KVCacheSpec,
    capacity: dict[str, int],
    network_write_through: bool = False,
) -> Cache:
    """Attach a cache (counted by outcome in kcaas_cache_attaches); see _attach."""
    with counted_outcome(CACHE_ATTACHES):
        return _attach(
            tenant_id=tenant_id,
            name=name,
            spec=spec,
            capacity=capacity,
            network_write_through=network_write_through,
        )


def _attach(
    *, tenant_id: uuid.UUID, name: str, spec: KVCacheSpec, capacity: dict[str, int], network_write_through: bool
) -> Cache:
    """Attach a cache: quota under the tenant lock, the network store's share, placement (node tiers only), the row,
    and provisioning sent on commit.

    Returns the cache in state `provisioning`. Refusals: 400 invalid_capacity (network_write_through without network
    bytes too), 409 cache_name_taken, 409 tenant_inactive, 403 quota_exceeded (naming the limit), 409
    network_tier_absent / 503 no_capacity (network_store), 503 no_capacity (fleet).
    """
    capacity = capacity_check(spec=spec, capacity=capacity)
    write_through_check(capacity=capacity, network_write_through=network_write_through)
    tenant = tenant_lock(tenant_id=tenant_id)
    if tenant.status != Tenant.Status.ACTIVE:
        raise ConflictError(f"The tenant is {tenant.status}.", code="tenant_inactive")
    taken = Cache.objects.filter(tenant_id=tenant.pk, name=name).exclude(state=CacheState.DETACHED).first()
    if taken is not None:  # the one that holds the name, so the caller can use it as is or detach it
        details = {"name": name, "cache_id": str(taken.pk), "state": str(taken.state)}
        raise CacheNameTaken("A cache with this name is attached.", details=details)
    _check_quota(tenant=tenant, capacity=capacity)
    network_store_reserve(nbytes=capacity["network"])
    node = node_place(capacity={tier: capacity[tier] for tier in NODE_TIERS})
    cache_id = uuid.uuid4()
    try:
        with transaction.atomic():
            cache = Cache.objects.create(
                id=cache_id,
                tenant=tenant,
                name=name,
                **spec.to_dict(),
                **{f"{tier}_capacity_bytes": capacity[tier] for tier in TIERS},
                network_write_through=network_write_through,
                state=CacheState.PENDING,
                node=node,
                epoch=1,
                hash_key_sealed=hash_key_new_sealed(cache_id=cache_id, tenant_id=tenant.pk),
                # the data key seals SSD records and names and seals network objects: a cache with either has one
                ssd_key_sealed=ssd_key_new_sealed(cache_id=cache_id, tenant_id=tenant.pk)
                if capacity["ssd"] or capacity["network"]
                else None,
            )
    except IntegrityError:  # the partial unique index: cannot happen under the tenant lock, but never a 500
        raise CacheNameTaken("A cache with this name is attached.", details={"name": name}) from None
    _provision(cache)
    _audit(
        AuditAction.CACHE_ATTACHED,
        cache,
        new={
            "name": cache.name,
            "spec": cache.spec_dict(),
            "capacity": cache.capacity(),
            "network_write_through": cache.network_write_through,
            "node_id": cache.node_id,
            "epoch": cache.epoch,
            "state": cache.state,
        },
    )
    return cache


def _audit(action: AuditAction, cache: Cache, *, old: dict | None = None, new: dict | None = None, actor=None) -> None:
    """One audit event about `cache` (its tenant's), last in the transaction: every lock is taken by now."""
    audit_record(
        action=action, target_type="cache", target_id=cache.pk, tenant_id=cache.tenant_id, old=old, new=new, actor=actor
    )


def _provision(cache: Cache) -> None:
    """Order the cache's provisioning from its node (through the outbox) and mark it provisioning until the node
    answers. The order row holds only the cache id and epoch: the keys are unsealed into the message at send time
    (provision_order_message), so no secret is ever stored in the outbox."""
    order_enqueue(
        node_id=cache.node_id,
        task=PROVISION_TASK,
        builder="caches.services.provision_order_message",
        builder_args=[str(cache.pk), cache.epoch],
        key=cache_key(cache.pk),
    )
    cache.state = CacheState.PROVISIONING
    cache.save(update_fields=["state", "updated_at"])


def reprovision_emptied(cache: Cache) -> None:
    """Its node came back without the cache's blocks: stamp `emptied_at` (the API shows the cache `contents:
    "cold"` until its node reports blocks again) and provision it again, same epoch and keys."""
    cache.emptied_at = timezone.now()
    cache.save(update_fields=["emptied_at", "updated_at"])
    _provision(cache)


def audit_cache_emptied(cache: Cache, *, actor=None) -> None:
    """The `cache_emptied` event, after the re-provisioning's: the tenant's trail says its blocks were lost."""
    new = {"emptied_at": cache.emptied_at, "node_id": str(cache.node_id)}
    _audit(AuditAction.CACHE_EMPTIED, cache, new=new, actor=actor)


def provision_order_message(cache_id: str, epoch: int) -> ProvisionCache | None:
    """The provisioning message for the outbox, made at send time: None once it is moot (the cache is no longer
    provisioning at that epoch, or its keys were shredded by an erasure). Its keys are sealed to the cache's node
    (fleet.outbox.seal_for_node: bound to this task, node, cache and field): the broker never sees them in clear. A
    node with no sealing key on record raises NodeSealingKeyMissing: nothing is sent."""
    cache = Cache.objects.filter(pk=cache_id, epoch=epoch, state=CacheState.PROVISIONING).first()
    if cache is None:
        return None
    try:
        hash_key = hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)
        ssd_key = ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed) if cache.ssd_key_sealed else None
    except SealError:
        logger.warning("cache %s: its keys do not open; provisioning not sent", cache.pk)
        return None

    def sealed(field: str, key: bytes) -> str:
        return seal_for_node(node_id=cache.node_id, task=PROVISION_TASK, cache_id=cache.pk, field=field, plaintext=key)

    return ProvisionCache(
        cache_id=str(cache.pk),
        spec=cache.spec_dict(),
        capacity=cache.capacity(),
        hash_key_box=sealed("hash_key", hash_key),
        epoch=cache.epoch,
        tenant_id=str(cache.tenant_id),
        ssd_key_box=sealed("ssd_key", ssd_key) if ssd_key is not None else "",  # only caches with SSD or network
        network_write_through=cache.network_write_through,
    )


@transaction.atomic
def caches_reconcile_node(*, node_id: uuid.UUID, held_cache_ids: list) -> list[dict]:
    """A node (re-)registered holding `held_cache_ids`: every cache placed on it that should be served
    (ready or provisioning) but is not held — the agent restarted and its pools are gone — is provisioned again
    (same epoch, same key; an empty pool until warm restart from SSD arrives) and reads `provisioning` until the
    node answers. Returns what the control plane now believes the node hosts."""
    held = {str(cache_id) for cache_id in held_cache_ids}
    lost = (
        Cache.objects.select_for_update(no_key=True)
        .filter(node_id=node_id, state__in=[CacheState.READY, CacheState.PROVISIONING])
        .exclude(id__in=[as_uuid(c) for c in held if as_uuid(c) is not None])
        .order_by("id")
    )
    again = []
    for cache in lost:
        logger.info("node %s no longer holds cache %s: provisioning it again", node_id, cache.pk)
        again.append((cache, cache.state))
        reprovision_emptied(cache)
    for cache, previous_state in again:
        _audit(AuditAction.CACHE_REPROVISIONED, cache, old={"state": previous_state}, new={"state": cache.state})
        audit_cache_emptied(cache)
    return selectors.caches_on_node(node_id=node_id)


# ---- detach ----------------------------------------------------------------------------------------------------------


def _lock_cache(cache_id, *, tenant_id: uuid.UUID | None = None) -> Cache | None:
    wanted = as_uuid(cache_id)
    if wanted is None:
        return None
    caches = Cache.objects.select_for_update(of=("self",), no_key=True)
    if tenant_id is not None:
        caches = caches.filter(tenant_id=tenant_id)
    return caches.filter(pk=wanted).first()


def _release(cache: Cache) -> None:
    """Give the cache's node reservation back; the caller moves it out of RESERVING_STATES in this transaction."""
    if cache.node_id is not None:
        node_unreserve(node_id=cache.node_id, capacity=cache.node_capacity())


def _revoke_tokens(cache: Cache, now: datetime, *, jti: uuid.UUID | None = None) -> int:
    """Revoke the cache's outstanding tokens (or the one `jti`) and tell its node on commit. Returns how many.
    The node also learns them from its next register/heartbeat answer (selectors.data_tokens_revoked_on_node)."""
    tokens = DataToken.objects.filter(cache=cache, revoked_at__isnull=True, expires_at__gt=now)
    if jti is not None:
        tokens = tokens.filter(jti=jti)
    revoked = list(tokens.values_list("jti", "expires_at"))
    if not revoked:
        return 0
    DataToken.objects.filter(jti__in=[j for j, _ in revoked]).update(revoked_at=now)
    if cache.node_id is not None:
        entries = [{"jti": str(j), "exp": int(expires_at.timestamp())} for j, expires_at in revoked]
        # no answer: the node also learns them from every register/heartbeat answer
        order_enqueue(
            node_id=cache.node_id,
            message=RevokeTokens(entries=entries),
            key=f"revoke:{uuid.uuid4()}",
            expects_answer=False,
        )
    return len(revoked)


@transaction.atomic
def data_tokens_revoke(*, cache_id, tenant_id: uuid.UUID | None, jti=None) -> int:
    """Revoke one data token of the cache (`jti`) or all its outstanding ones; idempotent (an already revoked or
    expired token counts 0). The cache's node refuses them from the moment the push arrives (at the latest its
    next heartbeat), on new HELLOs and on connections already authenticated with them.
    404 for another tenant's cache, or a jti that is not a token of this cache (tenant_id None: staff)."""
    cache = _lock_cache(cache_id, tenant_id=tenant_id)
    if cache is None:
        raise NotFoundError("No such cache.")
    wanted = None
    if jti is not None:
        wanted = as_uuid(jti)
        if wanted is None or not DataToken.objects.filter(cache=cache, jti=wanted).exists():
            raise NotFoundError("No such data token for this cache.")
    now = timezone.now()
    revoked = _revoke_tokens(cache, now, jti=wanted)
    if revoked:  # already revoked or expired: no change, no event
        _audit(AuditAction.DATA_TOKENS_REVOKED, cache, new={"revoked": revoked, "jti": wanted, "revoked_at": now})
    return revoked


@transaction.atomic
def cache_detach(*, cache_id: uuid.UUID, tenant_id: uuid.UUID | None) -> Cache:
    """Detach: pending/provisioning/ready -> detaching (the node is ordered to drop it; its answer finishes it);
    failed -> detached at once (it holds no reservation; the node is still told, to drop anything left).
    A detaching cache is returned as it is, its order sent again now; a detached one as it is.
    Outstanding data tokens are revoked. Another tenant's cache is a 404 (tenant_id None: any tenant, for staff)."""
    cache = _lock_cache(cache_id, tenant_id=tenant_id)
    if cache is None:
        raise NotFoundError("No such cache.")
    if cache.state == CacheState.DETACHING and cache.node_id is not None:
        _order_detach(cache, forget_network=True)  # asked again: re-drive the order now, not at its next resend
    if cache.state in (CacheState.DETACHING, CacheState.DETACHED):
        return cache
    now = timezone.now()
    _revoke_tokens(cache, now)
    old_state = cache.state
    cache.state = CacheState.DETACHED if cache.state == CacheState.FAILED else CacheState.DETACHING
    cache.save(update_fields=["state", "updated_at"])
    if cache.node_id is not None:
        _order_detach(cache, forget_network=True)
    _audit(AuditAction.CACHE_DETACH_REQUESTED, cache, old={"state": old_state}, new={"state": cache.state})
    return cache


# ---- the node's answers ----------------------------------------------------------------------------------------------


def _same_node(cache: Cache, node_id) -> bool:
    return cache.node_id is not None and str(cache.node_id) == str(node_id)


@transaction.atomic
def cache_provision_result(
    *, cache_id: uuid.UUID, node_id: uuid.UUID, ok: bool, reason: str = "", endpoint: str = ""
) -> Cache | None:
    """The node's answer to provisioning: provisioning -> ready (with the node's endpoint) or failed (with the
    reason, reservation released). Anything else (unknown cache, another node, another state) is a no-op; the
    node's provisioning order is acknowledged either way (the node answered it)."""
    cache = _lock_cache(cache_id)
    if cache is not None:
        orders_acknowledge(node_id=as_uuid(node_id), key=cache_key(cache.pk), tasks=(PROVISION_TASK,))
    if cache is None or not _same_node(cache, node_id) or cache.state != CacheState.PROVISIONING:
        logger.info("ignored provision result for cache %s from node %s", cache_id, node_id)
        return cache
    old = {"state": cache.state, "endpoint": cache.endpoint, "failure_reason": cache.failure_reason}
    if ok:
        cache.state = CacheState.READY
        cache.endpoint = (endpoint or cache.node.endpoint)[:300]
        cache.failure_reason = ""
    else:
        cache.state = CacheState.FAILED
        cache.failure_reason = (reason or "provisioning_failed")[:MAX_REASON_LENGTH]
        _release(cache)
    cache.save(update_fields=["state", "endpoint", "failure_reason", "updated_at"])
    new = {"state": cache.state, "endpoint": cache.endpoint, "failure_reason": cache.failure_reason}
    changed = [field for field in new if new[field] != old[field]]
    _audit(
        AuditAction.CACHE_READY if ok else AuditAction.CACHE_FAILED,
        cache,
        old={f: old[f] for f in changed},
        new={f: new[f] for f in changed},
    )
    return cache


@transaction.atomic
def cache_detach_result(*, cache_id: uuid.UUID, node_id: uuid.UUID) -> Cache | None:
    """The node confirms a detach: detaching -> detached, reservation released. Anything else is a no-op; the
    node's detach order is acknowledged either way (a migration's target confirms dropping its copy this way)."""
    cache = _lock_cache(cache_id)
    if cache is not None:
        orders_acknowledge(node_id=as_uuid(node_id), key=cache_key(cache.pk), tasks=(DETACH_TASK,))
    if cache is None or not _same_node(cache, node_id) or cache.state != CacheState.DETACHING:
        logger.info("ignored detach result for cache %s from node %s", cache_id, node_id)
        return cache
    cache.state = CacheState.DETACHED
    _release(cache)
    cache.save(update_fields=["state", "updated_at"])
    _audit(AuditAction.CACHE_DETACHED, cache, old={"state": CacheState.DETACHING}, new={"state": CacheState.DETACHED})
    return cache


@transaction.atomic
def caches_sweep_leases(*, now: datetime | None = None) -> list[uuid.UUID]:
    """Expire node leases (fleet) and flag the caches of lost nodes; returns the ids of the caches changed.

    Caches on a lost node: pending/provisioning/ready -> failed (`node_lost`), detaching -> detached (the tenant
    asked for it to go, and the node that held it is gone); both release the reservation. Caches of nodes that
    were already lost (marked by an earlier run, or by fleet itself) are flagged too, so a missed run loses nothing.
    The candidate caches are locked (id order) before fleet locks the nodes: the cache -> node lock order of every
    other service, so a sweep never deadlocks with a provisioning answer.
    """
    now = now or timezone.now()
    dying = Q(node__state=NodeState.LOST) | Q(
        node__state__in=[NodeState.READY, NodeState.DRAINING, NodeState.CORDONED], node__lease_expires_at__lt=now
    )
    candidates = list(
        Cache.objects.select_for_update(of=("self",), no_key=True)
        .filter(dying, state__in=RESERVING_STATES)
        .order_by("id")
    )
    lost = nodes_expire_unrecorded(now=now)
    lost_nodes = set(
        Cache.objects.filter(pk__in=[c.pk for c in candidates], node__state=NodeState.LOST).values_list(
            "node_id", flat=True
        )
    )
    changed, events = [], []
    for cache in candidates:
        if cache.node_id not in lost_nodes:
            continue  # a heartbeat renewed the lease meanwhile
        old = {"state": cache.state, "failure_reason": cache.failure_reason}
        if cache.state == CacheState.DETACHING:
            cache.state = CacheState.DETACHED
        else:
            cache.state, cache.failure_reason = CacheState.FAILED, NODE_LOST
        _release(cache)
        cache.save(update_fields=["state", "failure_reason", "updated_at"])
        changed.append(cache.pk)
        events.append((cache, old))
    if changed:
        logger.warning("caches flagged on lost nodes: %s", ", ".join(map(str, changed)))
    nodes_lost_record(lost=lost)  # the audit events last: every node and cache lock is taken by now
    for cache, old in events:
        new = {"state": cache.state, "failure_reason": cache.failure_reason}
        fields = [field for field in new if new[field] != old[field]]
        action = AuditAction.CACHE_DETACHED if cache.state == CacheState.DETACHED else AuditAction.CACHE_FAILED
        _audit(action, cache, old={f: old[f] for f in fields}, new={f: new[f] for f in fields}, actor=SYSTEM)
    return changed


# ---- data tokens -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IssuedToken:
    token: str  # the signed JWT, returned once and never stored
    claims: dict
    data_token: DataToken


@transaction.atomic
def data_token_issue(
    *,
    tenant_id: uuid.UUID,
    cache_id: uuid.UUID,
    access: str,
    ttl_seconds: int | None = None,
    api_key_id: uuid.UUID | None = None,
    platform_reader: bool = False,
) -> IssuedToken:
    """Issue a short-lived EdDSA JWT for one ready cache of the tenant (see caches.signing for its verification).

    Claims: iss, aud `cache:<id>`, sub `tenant:<id>`, iat = nbf, exp (ttl clamped to [60 s, the configured TTL]),
    jti, epoch, node, access ("read" | "readwrite") and scope (the same as OAuth scopes `kv:read [kv:write]`).
    The tenant's outstanding (unexpired, unrevoked) tokens are counted under the tenant lock: at most
    max_data_tokens_outstanding (403 quota_exceeded). 404 for another tenant's cache, 409 cache_not_ready.
    `api_key_id`: the key that asked for it; revoking (or expiring) that key revokes the token
    (caches.token_cascade), as suspending or erasing the tenant does.
    `platform_reader`: a read token the control plane issues itself (the routing indexer reading the cache's
    events): audited like any, not counted in (nor refused by) the tenant's outstanding quota.
    """
    if access not in ACCESS_LEVELS:
        raise ValueError(f"access must be one of {ACCESS_LEVELS}")
    if platform_reader and access != "read":
        raise ValueError("the platform issues itself read tokens only")
    tenant = tenant_lock(tenant_id=tenant_id)
    if tenant.status != Tenant.Status.ACTIVE:
        raise ConflictError(f"The tenant is {tenant.status}.", code="tenant_inactive")
    wanted = as_uuid(cache_id)
    cache = Cache.objects.select_related("node").filter(pk=wanted, tenant_id=tenant.pk).first() if wanted else None
    if cache is None:
        raise NotFoundError("No such cache.")
    if cache.state != CacheState.READY:
        raise CacheNotReady(f"The cache is {cache.state}, not ready.", details={"state": cache.state})
    limit = quota_limits(tenant=tenant).max_data_tokens_outstanding
    issued_at = int(time.time())
    now = datetime.fromtimestamp(issued_at, tz=UTC)
    outstanding = selectors.data_tokens_outstanding(tenant_id=tenant.pk, now=now)
    if outstanding >= limit and not platform_reader:
        raise QuotaExceeded(
            f"The tenant may hold at most {limit} outstanding data tokens.",
            details={"limit": "max_data_tokens_outstanding", "limit_value": limit, "in_use": outstanding},
        )
    max_ttl = settings.KCAAS_DATA_TOKEN_TTL_SECONDS
    ttl = max_ttl if ttl_seconds is None else max(min(ttl_seconds, max_ttl), min(MIN_TOKEN_TTL_SECONDS, max_ttl))
    data_token = DataToken.objects.create(
        cache=cache,
        tenant=tenant,
        access=access,
        issued_at=now,
        expires_at=now + timedelta(seconds=ttl),
        api_key_id=api_key_id,
        platform_reader=platform_reader,
    )
    audit_record(
        action=AuditAction.DATA_TOKEN_ISSUED,
        target_type="data_token",
        target_id=data_token.jti,
        tenant_id=tenant.pk,
        new={
            "cache_id": cache.pk,
            "access": access,
            "epoch": cache.epoch,
            "expires_at": data_token.expires_at,
            **({"platform_reader": True} if platform_reader else {}),
        },
    )  # never the token
    claims = {
        "iss": settings.KCAAS_TOKEN_ISSUER,
        "aud": f"cache:{cache.pk}",
        "sub": f"tenant:{tenant.pk}",
        "iat": issued_at,
        "nbf": issued_at,
        "exp": issued_at + ttl,
        "jti": str(data_token.jti),
        "epoch": cache.epoch,
        "node": str(cache.node_id),
        "access": access,
        "scope": "kv:read kv:write" if access == "readwrite" else "kv:read",
    }
    return IssuedToken(token=token_sign(claims), claims=claims, data_token=data_token)


@transaction.atomic
def data_tokens_purge(*, now: datetime | None = None, keep_seconds: int = 24 * 3600) -> int:
    """Delete token rows expired more than `keep_seconds` ago (they no longer count); returns how many."""
    cutoff = (now or timezone.now()) - timedelta(seconds=keep_seconds)
    deleted, _ = DataToken.objects.filter(expires_at__lt=cutoff).delete()
    return deleted


# ---- erasure (the privacy room calls this) ---------------------------------------------------------------------------


@transaction.atomic
def caches_detach_tenant(*, tenant_id: uuid.UUID) -> list[dict]:
    """Erasure: every cache of the tenant leaves service at once, without a detach message to its node (the privacy
    room's purge_tenant drops the tenant's pools on every node). Outstanding data tokens are revoked (pushed to the
    nodes), caches still reserving release their reservation, all become detached. Returns the caches changed,
    [{"cache_id", "node_id", "state"}] with the state before; idempotent (a rerun changes nothing, returns []).
    Every cache is locked (id order) before their nodes (id order), and those before the token orders."""
    now = timezone.now()
    live = list(
        Cache.objects.select_for_update(of=("self",), no_key=True)
        .filter(tenant_id=tenant_id)
        .exclude(state=CacheState.DETACHED)
        .order_by("id")
    )
    changed = [{"cache_id": str(c.pk), "node_id": str(c.node_id or ""), "state": c.state} for c in live]
    nodes_lock(node_ids=[cache.node_id for cache in live if cache.state in RESERVING_STATES])
    for cache in live:
        if cache.state in RESERVING_STATES:
            _release(cache)
        cache.state = CacheState.DETACHED
        cache.save(update_fields=["state", "updated_at"])
    for cache in live:
        _revoke_tokens(cache, now)
    DataToken.objects.filter(tenant_id=tenant_id, revoked_at__isnull=True).update(revoked_at=now)
    return changed
