"""The tenant's quota limits next to its consumption (GET /api/v1/usage), as `kcaas.Client.usage()` returns them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# (what is used, the limit it counts against): the keys of `Usage.used` and `Usage.limits` the quota checks pair.
QUOTA_PAIRS = (
    ("caches", "max_caches"),
    ("device_bytes", "max_device_bytes"),
    ("dram_bytes", "max_dram_bytes"),
    ("ssd_bytes", "max_ssd_bytes"),
    ("network_bytes", "max_network_bytes"),  # the fleet's network store
    ("data_tokens_outstanding", "max_data_tokens_outstanding"),
    ("api_keys", "max_api_keys"),
)


@dataclass(frozen=True, kw_only=True)
class Usage:
    """`limits`: the effective quota (max_caches, max_device_bytes, ..., max_requests_per_second); `used`: what the
    quota checks count (caches, device/dram/ssd_bytes reserved, data_tokens_outstanding); `resident`: bytes per tier
    the nodes last reported holding; `series`: the metered usage of a period, when one was asked for. Keys a newer
    server adds are kept; none is required."""

    tenant_id: str | None = None
    limits: Mapping[str, int] = field(default_factory=dict)
    used: Mapping[str, int] = field(default_factory=dict)
    resident: Mapping[str, int] = field(default_factory=dict)
    # With a period: {"from", "to", "granularity", "buckets": [{"period_start", "<tier>_byte_seconds",
    # "<tier>_gb_hours" (exact decimal strings), "bytes_written", "tokens_served"}]}; None without one.
    series: Mapping[str, Any] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Usage:
        return cls(
            tenant_id=data.get("tenant_id"),
            limits=dict(data.get("limits") or {}),
            used=dict(data.get("used") or {}),
            resident=dict(data.get("resident") or {}),
            series=data.get("series"),
        )

    def remaining(self) -> dict[str, int]:
        """Headroom per quota-checked resource (limit - used, at least 0), keyed like `used`."""
        return {
            used: max(0, int(self.limits[limit]) - int(self.used.get(used, 0)))
            for used, limit in QUOTA_PAIRS
            if limit in self.limits
        }
