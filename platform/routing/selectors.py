"""Reads of the routing room: a tenant's instances, and for a prompt the longest prefix each of them holds, per
medium. Every read is confined to one tenant."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from django.db.models import Count, Q

from core.errors import NotFoundError
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
    the prompt's start, contiguous), and its load signal (blocks indexed in device memory)."""

    instance: EngineInstance
    prefix_tokens: dict[str, int] = field(default_factory=dict)
    used_blocks: int = 0


def prefix_lookup(
    *, tenant_id: uuid.UUID, model: str, token_ids: list[int], lora_name: str | None = None
) -> list[InstanceHit]:
    """For each live instance of the tenant serving `model`: how much of `token_ids` it holds, per medium."""
    instances = list(
        EngineInstance.objects.filter(tenant_id=tenant_id, model=model, state=InstanceState.LIVE).order_by("name")
    )
    hits = {i.id: InstanceHit(i) for i in instances}
    by_size: dict[int, list[EngineInstance]] = defaultdict(list)
    for instance in instances:
        by_size[instance.block_size].append(instance)
    for size, group in by_size.items():
        keys = [k.hex() for k in block_keys(token_ids, size, lora_name=lora_name)]
        if not keys:
            continue
        position = {key: i for i, key in enumerate(keys)}
        held: dict[tuple[uuid.UUID, str], set[int]] = defaultdict(set)
        rows = IndexedBlock.objects.filter(instance__in=group, block_key__in=keys).values_list(
            "instance_id", "medium", "block_key"
        )
        for instance_id, medium, key in rows:
            held[(instance_id, medium)].add(position[key])
        for (instance_id, medium), indices in held.items():
            run = 0
            while run in indices:
                run += 1
            hits[instance_id].prefix_tokens[medium] = run * size
    used = (
        IndexedBlock.objects.filter(instance__in=instances)
        .values("instance_id")
        .annotate(n=Count("id", filter=Q(medium="GPU")))
    )
    for row in used:
        hits[row["instance_id"]].used_blocks = row["n"]
    return list(hits.values())
