"""Cascading revocation: data tokens die with what they were minted under.

A data token is short-lived (minutes) but verified offline by the node, so revoking the API key that minted it, or
suspending or erasing its tenant, must reach the node too — else the key's tokens (up to the tenant's quota of
outstanding ones) keep working until they expire and a suspended tenant keeps its live connections.

Two paths, both bounded in time and idempotent:
- every register and heartbeat answer lists, beside the tokens revoked one by one, every unexpired token cut off
  with its tenant or key (selectors.data_tokens_cut_off): a node refuses them (and cuts their sessions) at the
  latest one heartbeat later, even if nothing else ran;
- `data_tokens_revoke_cascade` marks them revoked and pushes them to their nodes through the outbox (the
  `revoke_tokens` order, as a single revocation does): beat runs it every KCAAS_TOKEN_CASCADE_SECONDS, and the
  console and the erasure call it at once after suspending a tenant or revoking a key.

This room may read tenants and keys (a lower room); the tenants room cannot call it (no upward imports), which is
why the beat task exists: a suspension or revocation made through the tenants API is swept up within seconds.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import audit_record
from caches.models import DataToken
from caches.selectors import data_tokens_cut_off
from fleet.outbox import order_enqueue
from kcaas.node_protocol.messages import RevokeTokens

MAX_PER_RUN = 10_000  # tokens revoked per run; the rest are listed in heartbeats until the next run


@transaction.atomic
def data_tokens_revoke_cascade(*, tenant_id: uuid.UUID | None = None, now: datetime | None = None) -> int:
    """Revoke every unexpired, unrevoked token cut off with its tenant or key (of one tenant, or all), push them to
    their caches' nodes, and audit one event per cache. Returns how many were revoked."""
    now = now or timezone.now()
    tokens = DataToken.objects.filter(data_tokens_cut_off(now=now), revoked_at__isnull=True, expires_at__gt=now)
    if tenant_id is not None:
        tokens = tokens.filter(tenant_id=tenant_id)
    rows = list(
        tokens.select_for_update(of=("self",), skip_locked=True).values_list(
            "jti", "expires_at", "cache_id", "cache__node_id", "tenant_id"
        )[:MAX_PER_RUN]
    )
    if not rows:
        return 0
    DataToken.objects.filter(jti__in=[row[0] for row in rows]).update(revoked_at=now)
    by_node, by_cache = defaultdict(list), defaultdict(int)
    for jti, expires_at, cache_id, node_id, tenant in rows:
        by_cache[(cache_id, tenant)] += 1
        if node_id is not None:
            by_node[node_id].append({"jti": str(jti), "exp": int(expires_at.timestamp())})
    for node_id, entries in by_node.items():  # no answer: the node also learns them from every heartbeat answer
        order_enqueue(
            node_id=node_id, message=RevokeTokens(entries=entries), key=f"revoke:{uuid.uuid4()}", expects_answer=False
        )
    for (cache_id, tenant), count in sorted(by_cache.items(), key=lambda item: str(item[0][0])):
        audit_record(
            action=AuditAction.DATA_TOKENS_REVOKED,
            target_type="cache",
            target_id=cache_id,
            tenant_id=tenant,
            new={"revoked": count, "reason": "tenant_or_key", "revoked_at": now},
        )
    return len(rows)
