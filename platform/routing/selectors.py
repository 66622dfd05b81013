"""Reads of the routing room: a tenant's instances, and for a prompt the longest prefix each of them and each of its
followed caches holds, per medium. Every read is confined to one tenant."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from django.db.models import Count, Q

from caches.models import Cache
from core.errors import NotFoundError
from kcaas.kv_events import MEDIA
from routing.chain import block_keys
from routing.models import EngineInstance, IndexedBlock, InstanceState


def instances_list(*, tenant_id: uuid.UUID):
    return EngineInstance.objects.filter(tenant_id=tenant_id).order_by("name")


def instance_get(*, instance_id: uuid.UUID, tenant_id: uuid.UUID) -> EngineInstance:
    instance = EngineInstance.objects.filter(id=instance_id, tenant_id=tenant_id).first()
    if instance is None:
        raise NotFoundError("No such engine instance.")
    return instance


@dataclass
class InstanceHit:
    """One instance's answer for a prompt: the tokens of its longest cached prefix per medium (whole blocks, from
    the prompt's start, contiguous, held in that medium or a faster one: MEDIA order), and its load signal (blocks
    indexed in device memory)."""

    instance: EngineInstance
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    used_blocks: int = 0


@dataclass
class CacheHit:
    """One followed cache's answer for a prompt, as InstanceHit's: per tier (GPU: the node's device pool, CPU: its
    DRAM, STORAGE: its SSD, NETWORK: the fleet's network store) and blocks indexed in its device pool."""

    cache: Cache
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    used_blocks: int = 0


@dataclass
class LookupAnswer:
    instances: list[InstanceHit]
    caches: list[CacheHit]


def prefix_lookup(
    *, tenant_id: uuid.UUID, model: str, token_ids: list[int], lora_name: str | None = None
) -> LookupAnswer:
    """For each live instance of the tenant serving `model`, and each cache of the tenant the indexer follows: how
    much of `token_ids` it holds, per medium."""
    instances = list(
        EngineInstance.objects.filter(tenant_id=tenant_id, model=model, state=InstanceState.LIVE).order_by("name")
    )
    caches = list(Cache.objects.filter(tenant_id=tenant_id, follow__isnull=False).order_by("name"))
    instance_hits = {i.id: InstanceHit(i) for i in instances}
    cache_hits = {c.id: CacheHit(c) for c in caches}
    _fill(instance_hits, "instance_id", {i.id: i.block_size for i in instances}, token_ids, lora_name)
    _fill(cache_hits, "cache_id", {c.id: c.block_size for c in caches}, token_ids, lora_name)
    return LookupAnswer(list(instance_hits.values()), list(cache_hits.values()))


def _fill(hits: dict, owner_field: str, block_sizes: dict, token_ids: list[int], lora_name: str | None) -> None:
    """Set each hit's prefix per medium and its used blocks from the index rows of its owner (`owner_field`)."""
    by_size: dict[int, list[uuid.UUID]] = defaultdict(list)
    for owner_id, size in block_sizes.items():
        by_size[size].append(owner_id)
    for size, owners in by_size.items():
        keys = [k.hex() for k in block_keys(token_ids, size, lora_name=lora_name)]
        if not keys:
            continue
        position = {key: i for i, key in enumerate(keys)}
        held: dict[uuid.UUID, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
        rows = IndexedBlock.objects.filter(**{f"{owner_field}__in": owners, "block_key__in": keys})
        for owner_id, medium, key in rows.values_list(owner_field, "medium", "block_key"):
            held[owner_id][medium].add(position[key])
        for owner_id, media in held.items():
            hits[owner_id].prefix_tokens = {m: run * size for m, run in _runs_per_medium(media).items() if run}
    used = (
        IndexedBlock.objects.filter(**{f"{owner_field}__in": list(block_sizes)})
        .values(owner_field)
        .annotate(n=Count("id", filter=Q(medium="GPU")))
    )
    for row in used:
        hits[row[owner_field]].used_blocks = row["n"]


def _runs_per_medium(held: dict[str, set[int]]) -> dict[str, int]:
    """Per medium: how many blocks from the prompt's start are held in it or a faster medium (MEDIA order; a medium
    MEDIA does not name is counted after them all)."""
    rank = {medium: i for i, medium in enumerate(MEDIA)}
    runs = {}
    for medium in held:
        faster = set().union(
            *(blocks for m, blocks in held.items() if rank.get(m, len(MEDIA)) <= rank.get(medium, len(MEDIA)))
        )
        run = 0
        while run in faster:
            run += 1
        runs[medium] = run
    return runs
