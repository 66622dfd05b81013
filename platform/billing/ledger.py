"""The ledger's arithmetic: one cache's samples -> its usage per UTC hour. Pure functions (no database), so the
ledger is exactly reproducible from the samples and the rules can be tested on their own.

Rules (docs/compliance.md, billing):
- Resident bytes: the samples of a cache, from every node and boot, are ordered by (sampled_at, node, boot,
  sequence); each sample's bytes hold from its time to the next sample's time, at most `max_gap` seconds (the
  last one holds `max_gap`). Integrated per tier into integer byte-seconds (times are whole seconds).
- Counters (bytes written, tokens served) are absolute since the agent's boot: within one (node, boot) in sequence
  order, each sample adds its increase over the previous one to the hour it was sampled in; a boot's first sample
  counts from 0; a decrease means the counter restarted (it counts from 0 again).
Because every quantity is a function of the set of samples (never of their arrival order), duplicate or reordered
reports change nothing, and a restart (a new boot) neither loses nor doubles usage.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

HOUR = 3600
TIERS: tuple[str, ...] = ("device", "dram", "ssd", "network")


@dataclass(frozen=True, slots=True)
class Sample:
    node_id: str
    boot_id: str
    sequence: int
    sampled_at: int  # unix seconds
    device_bytes: int
    dram_bytes: int
    ssd_bytes: int
    bytes_written_total: int
    tokens_served_total: int
    network_bytes: int = 0  # the cache's objects in the fleet's network store (0: no network tier)

    @property
    def order_key(self) -> tuple:
        return (self.sampled_at, self.node_id, self.boot_id, self.sequence)


@dataclass(slots=True)
class HourUsage:
    byte_seconds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_written: int = 0
    tokens_served: int = 0

    def is_zero(self) -> bool:
        return not any(self.byte_seconds.values()) and not self.bytes_written and not self.tokens_served


def hour_floor(seconds: int) -> int:
    return seconds - seconds % HOUR


def _add_resident(usage: dict[int, HourUsage], sample: Sample, begin: int, end: int) -> None:
    """Add sample's bytes held over [begin, end) to each hour it overlaps."""
    at = begin
    while at < end:
        hour = hour_floor(at)
        until = min(end, hour + HOUR)
        bucket = usage.setdefault(hour, HourUsage())
        for tier in TIERS:
            bucket.byte_seconds[tier] += getattr(sample, f"{tier}_bytes") * (until - at)
        at = until


def _integrate_resident(samples: list[Sample], start: int, end: int, max_gap: int, usage: dict) -> None:
    ordered = sorted(samples, key=lambda s: s.order_key)
    for index, sample in enumerate(ordered):
        held_until = sample.sampled_at + max_gap
        if index + 1 < len(ordered):
            held_until = min(held_until, ordered[index + 1].sampled_at)
        begin, finish = max(sample.sampled_at, start), min(held_until, end)
        if begin < finish:
            _add_resident(usage, sample, begin, finish)


def _increase(previous: int | None, current: int) -> int:
    """What a since-boot counter grew by; a boot's first sample and a restarted (smaller) counter count from 0."""
    if previous is None or current < previous:
        return current
    return current - previous


def _integrate_counters(samples: list[Sample], start: int, end: int, usage: dict) -> None:
    boots: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for sample in samples:
        boots[(sample.node_id, sample.boot_id)].append(sample)
    for boot_samples in boots.values():
        previous: Sample | None = None
        for sample in sorted(boot_samples, key=lambda s: s.sequence):
            if start <= sample.sampled_at < end:
                bucket = usage.setdefault(hour_floor(sample.sampled_at), HourUsage())
                bucket.bytes_written += _increase(previous and previous.bytes_written_total, sample.bytes_written_total)
                bucket.tokens_served += _increase(previous and previous.tokens_served_total, sample.tokens_served_total)
            previous = sample


def integrate(samples: list[Sample], *, start: int, end: int, max_gap: int) -> dict[int, HourUsage]:
    """Usage per hour (keyed by the hour's start, unix seconds) for the hours in [start, end) (hour aligned).

    `samples` must hold every sample of the cache sampled in [start - max_gap, end) and, for each (node, boot)
    among them, the boot's last sample (by sequence) before that (its counters' baseline; see `window_lower`).
    Hours without usage are left out."""
    assert start % HOUR == 0 and end % HOUR == 0 and max_gap > 0
    usage: dict[int, HourUsage] = {}
    _integrate_resident(samples, start, end, max_gap, usage)
    _integrate_counters(samples, start, end, usage)
    return {hour: bucket for hour, bucket in usage.items() if not bucket.is_zero()}


def window_lower(start: int, max_gap: int) -> int:
    """The earliest sampled_at that can contribute resident bytes to hours from `start`."""
    return start - max_gap
