"""Prometheus metrics of a node agent, labelled by cache id (never by tenant secrets or keys).

Engine counters (hit/miss tokens, stored tokens, evictions, copy-on-write copies, blocks and resident bytes) are
read from each hosted cache's `stats()` at scrape time by a custom collector: nothing is added to the hot path.
Request latency, TLS handshakes and authentication failures are events of the data plane, counted there through
the histograms and counters defined here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpu_node.registry import CacheRegistry

OPS = ("hello", "lookup", "put", "get", "delete")


class CacheStatsCollector:
    """Yields the engine counters of every hosted cache at scrape time."""

    def __init__(self, registry: CacheRegistry):
        self._registry = registry

    def collect(self):
        counters = {
            "hit_tokens": CounterMetricFamily("kcaas_cache_hit_tokens", "Tokens served from cache", labels=["cache"]),
            "miss_tokens": CounterMetricFamily(
                "kcaas_cache_miss_tokens", "Tokens asked and not cached", labels=["cache"]
            ),
            "stored_tokens": CounterMetricFamily(
                "kcaas_cache_stored_tokens", "Tokens written by puts", labels=["cache"]
            ),
            "evictions": CounterMetricFamily(
                "kcaas_cache_evictions", "Cached blocks evicted under pressure", labels=["cache"]
            ),
            "cow_copies": CounterMetricFamily(
                "kcaas_cache_cow_copies", "Partial blocks copied on write", labels=["cache"]
            ),
            "checksum_failures": CounterMetricFamily(
                "kcaas_block_checksum_failures",
                "Lower-tier blocks dropped for a checksum (or AES-GCM tag) mismatch",
                labels=["cache", "where"],
            ),
        }
        gauges = {
            "used_blocks": GaugeMetricFamily("kcaas_cache_used_blocks", "Blocks holding data", labels=["cache"]),
            "free_blocks": GaugeMetricFamily("kcaas_cache_free_blocks", "Blocks holding nothing", labels=["cache"]),
            "resident_bytes": GaugeMetricFamily(
                "kcaas_cache_resident_bytes", "Bytes resident per tier", labels=["cache", "tier"]
            ),
            "capacity_bytes": GaugeMetricFamily("kcaas_cache_capacity_bytes", "Pool bytes", labels=["cache", "tier"]),
        }
        for cache_id in self._registry.cache_ids():
            hosted = self._registry.get(cache_id)
            if hosted is None:
                continue
            stats = hosted.engine.stats()
            counters["hit_tokens"].add_metric([cache_id], stats.num_hit_tokens)
            counters["miss_tokens"].add_metric([cache_id], stats.num_miss_tokens)
            counters["stored_tokens"].add_metric([cache_id], stats.num_stored_tokens)
            counters["evictions"].add_metric([cache_id], stats.num_evictions)
            counters["cow_copies"].add_metric([cache_id], stats.num_cow_copies)
            gauges["used_blocks"].add_metric([cache_id], stats.num_used_blocks)
            gauges["free_blocks"].add_metric([cache_id], stats.num_free_blocks)
            gauges["resident_bytes"].add_metric([cache_id, "device"], stats.bytes_resident)
            gauges["capacity_bytes"].add_metric([cache_id, "device"], stats.bytes_capacity)
            self._add_lower_tiers(cache_id, hosted, counters, gauges)
        yield from counters.values()
        yield from gauges.values()

    @staticmethod
    def _add_lower_tiers(cache_id: str, hosted, counters: dict, gauges: dict) -> None:
        lower = hosted.engine.tiers
        resident = lower.resident_bytes() if lower is not None else {}
        failures = lower.checksum_failures() if lower is not None else {}
        for tier in ("dram", "ssd"):
            gauges["resident_bytes"].add_metric([cache_id, tier], resident.get(tier, 0))
            gauges["capacity_bytes"].add_metric([cache_id, tier], hosted.capacity.get(tier, 0))
            counters["checksum_failures"].add_metric([cache_id, tier], failures.get(tier, 0))


class NodeMetrics:
    """The metrics registry of one agent: engine counters plus the data plane's own events."""

    def __init__(self, cache_registry: CacheRegistry):
        self.registry = CollectorRegistry()
        self.registry.register(CacheStatsCollector(cache_registry))
        self.request_seconds = Histogram(
            "kcaas_dataplane_request_seconds",
            "Data-plane request latency",
            ["op"],
            registry=self.registry,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.tls_handshakes = Counter(
            "kcaas_dataplane_tls_handshakes", "TLS handshakes", ["outcome"], registry=self.registry
        )
        self.auth_failures = Counter(
            "kcaas_dataplane_auth_failures", "Refused data tokens", ["reason"], registry=self.registry
        )
        self.migration_blocks_refused = Counter(
            "kcaas_migration_blocks_refused",
            "Blocks a migration target refused (checksum, chain, ...): resent",
            ["reason"],
            registry=self.registry,
        )
        self.migration_blocks_received = Counter(
            "kcaas_migration_blocks_received",
            "Blocks a migration target received, by verdict (stored, have, ...)",
            ["verdict"],
            registry=self.registry,
        )
        self.migration_blocks_restored = Counter(
            "kcaas_migration_blocks_restored",
            "Blocks a restarted migration target republished from its SSD journal",
            registry=self.registry,
        )
        self.overloaded = Counter(
            "kcaas_dataplane_overloaded",
            "Requests refused by an admission limit (connections, requests or bytes in flight)",
            ["limit"],
            registry=self.registry,
        )

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics over HTTP (prometheus_client's server, in a daemon thread); returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
