"""Stored time series of what nodes report in their heartbeats: resident bytes per tier and hit/miss token counters
per cache (fleet.models.ResidentSample), for the console's charts.

`samples_record` runs inside `node_heartbeat` (same transaction, the node row locked): it keeps at most one
heartbeat per node per KCAAS_SAMPLE_SECONDS, so a node heartbeating every few seconds adds one row per cache per
interval. `samples_prune` (beat, hourly) forgets rows older than KCAAS_SAMPLE_RETENTION_DAYS. `resident_series`
reads them back in fixed buckets: per bucket, the latest sample of each (node, cache) in it, summed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from fleet.models import RESIDENT_TIERS as TIERS
from fleet.models import Node, ResidentSample

COUNTERS = ("hit_tokens", "miss_tokens")


def sample_seconds() -> int:
    return int(getattr(settings, "KCAAS_SAMPLE_SECONDS", 60))


def retention_days() -> int:
    return int(getattr(settings, "KCAAS_SAMPLE_RETENTION_DAYS", 30))


def samples_record(*, node: Node, snapshot: dict, now: datetime) -> int:
    """Store `snapshot` (fleet.services._snapshot's {"caches": {id: {tier: bytes, counters}}}) as samples of `node`
    at `now`, unless the node has a sample less than KCAAS_SAMPLE_SECONDS old. Returns the rows written."""
    recent = now - timedelta(seconds=sample_seconds())
    if ResidentSample.objects.filter(node=node, sampled_at__gt=recent, sampled_at__lte=now).exists():
        return 0
    rows = [
        ResidentSample(
            node=node,
            cache_id=uuid.UUID(cache_id),
            sampled_at=now,
            **{f"{tier}_bytes": int(entry.get(tier, 0)) for tier in TIERS},
            **{name: int(entry.get(name, 0) or 0) for name in COUNTERS},
        )
        for cache_id, entry in snapshot.get("caches", {}).items()
    ]
    ResidentSample.objects.bulk_create(rows)
    return len(rows)


def samples_prune(*, now: datetime | None = None) -> int:
    """Delete samples older than KCAAS_SAMPLE_RETENTION_DAYS; returns how many."""
    cutoff = (now or timezone.now()) - timedelta(days=retention_days())
    deleted, _ = ResidentSample.objects.filter(sampled_at__lt=cutoff).delete()
    return deleted


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One bucket [start, start + bucket): resident bytes per tier and the hit/miss counters, summed over the latest
    sample of each (node, cache) in the bucket; `samples` counts those (0: nothing was reported in the bucket)."""

    start: datetime
    resident_bytes: dict[str, int]
    hit_tokens: int
    miss_tokens: int
    samples: int

    @property
    def hit_rate(self) -> float | None:
        asked = self.hit_tokens + self.miss_tokens
        return None if asked == 0 else self.hit_tokens / asked


def resident_series(
    *,
    start: datetime,
    end: datetime,
    bucket: timedelta,
    node_id: uuid.UUID | None = None,
    cache_ids: Iterable[uuid.UUID] | None = None,
) -> list[SeriesPoint]:
    """Every bucket from `start` to `end` (oldest first), for the whole fleet, one node, or the given caches."""
    rows = ResidentSample.objects.filter(sampled_at__gte=start, sampled_at__lt=end)
    if node_id is not None:
        rows = rows.filter(node_id=node_id)
    if cache_ids is not None:
        rows = rows.filter(cache_id__in=list(cache_ids))
    fields = ("node_id", "cache_id", "sampled_at", *(f"{t}_bytes" for t in TIERS), *COUNTERS)
    latest: dict[tuple[int, uuid.UUID, uuid.UUID], dict] = {}
    for row in rows.order_by("sampled_at").values(*fields):
        index = int((row["sampled_at"] - start) / bucket)
        latest[(index, row["node_id"], row["cache_id"])] = row  # later rows replace earlier ones
    by_bucket: dict[int, list[dict]] = {}
    for (index, _, _), row in latest.items():
        by_bucket.setdefault(index, []).append(row)
    points = []
    for index in range(max(int((end - start) / bucket), 1)):
        chosen = by_bucket.get(index, [])
        points.append(
            SeriesPoint(
                start=start + index * bucket,
                resident_bytes={tier: sum(r[f"{tier}_bytes"] for r in chosen) for tier in TIERS},
                hit_tokens=sum(r["hit_tokens"] for r in chosen),
                miss_tokens=sum(r["miss_tokens"] for r in chosen),
                samples=len(chosen),
            )
        )
    return points
