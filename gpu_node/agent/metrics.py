"""Prometheus metrics of a node agent, labelled by cache id and its tenant's id (never by secrets or keys).

Engine counters (hit/miss tokens, stored tokens, evictions, copy-on-write copies, blocks, resident bytes and bytes
moved per op and tier) are read from each hosted cache's `stats()` and lower tiers at scrape time by a custom
collector: nothing is added to the hot path. A cache belongs to one tenant, so the `tenant` label adds no series:
the cardinality is the caches one node hosts. Node-wide figures (capacity and use per tier, the heartbeat's age)
come from the same collector. Request latency, TLS handshakes and authentication failures are events of the data
plane, counted there through the histograms and counters defined here. No `_created` series are exported.
docs/observability.md lists every metric.
"""

from __future__ import annotations

import importlib.metadata
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpu_node.agent.registry import CacheRegistry

disable_created_metrics()

OPS = ("hello", "lookup", "put", "get", "delete")
TIERS = ("device", "dram", "ssd", "network")
LOWER_TIERS = ("dram", "ssd", "network")
CACHE = ["cache", "tenant"]


class CacheStatsCollector:
    """Yields the engine counters of every hosted cache at scrape time."""

    def __init__(self, registry: CacheRegistry, node: NodeFigures):
        self._registry = registry
        self._node = node

    def collect(self):
        counters = {
            "hit_tokens": CounterMetricFamily("kcaas_cache_hit_tokens", "Tokens served from cache", labels=CACHE),
            "miss_tokens": CounterMetricFamily("kcaas_cache_miss_tokens", "Tokens asked and not cached", labels=CACHE),
            "stored_tokens": CounterMetricFamily("kcaas_cache_stored_tokens", "Tokens written by puts", labels=CACHE),
            "evictions": CounterMetricFamily(
                "kcaas_cache_evictions", "Cached blocks evicted under pressure", labels=CACHE
            ),
            "cow_copies": CounterMetricFamily("kcaas_cache_cow_copies", "Partial blocks copied on write", labels=CACHE),
            "checksum_failures": CounterMetricFamily(
                "kcaas_block_checksum_failures",
                "Lower-tier blocks dropped for a checksum (or AES-GCM tag) mismatch",
                labels=[*CACHE, "where"],
            ),
        }
        gauges = {
            "used_blocks": GaugeMetricFamily("kcaas_cache_used_blocks", "Blocks holding data", labels=CACHE),
            "free_blocks": GaugeMetricFamily("kcaas_cache_free_blocks", "Blocks holding nothing", labels=CACHE),
            "resident_bytes": GaugeMetricFamily(
                "kcaas_cache_resident_bytes", "Bytes resident per tier", labels=[*CACHE, "tier"]
            ),
            "capacity_bytes": GaugeMetricFamily("kcaas_cache_capacity_bytes", "Pool bytes", labels=[*CACHE, "tier"]),
        }
        counters["bytes_moved"] = CounterMetricFamily(
            "kcaas_node_bytes_moved",
            "KV bytes moved: put (written into a tier), get (read out of it), migrate (received from a peer)",
            labels=[*CACHE, "op", "tier"],
        )
        used = dict.fromkeys(TIERS, 0)
        for cache_id in self._registry.cache_ids():
            hosted = self._registry.get(cache_id)
            if hosted is None:
                continue
            labels = [cache_id, hosted.tenant_id]
            stats = hosted.engine.stats()
            counters["hit_tokens"].add_metric(labels, stats.num_hit_tokens)
            counters["miss_tokens"].add_metric(labels, stats.num_miss_tokens)
            counters["stored_tokens"].add_metric(labels, stats.num_stored_tokens)
            counters["evictions"].add_metric(labels, stats.num_evictions)
            counters["cow_copies"].add_metric(labels, stats.num_cow_copies)
            gauges["used_blocks"].add_metric(labels, stats.num_used_blocks)
            gauges["free_blocks"].add_metric(labels, stats.num_free_blocks)
            gauges["resident_bytes"].add_metric([*labels, "device"], stats.bytes_resident)
            gauges["capacity_bytes"].add_metric([*labels, "device"], stats.bytes_capacity)
            token_bytes = hosted.spec.block_bytes // hosted.spec.block_size
            moved = counters["bytes_moved"]
            moved.add_metric([*labels, "put", "device"], stats.num_stored_tokens * token_bytes)
            moved.add_metric([*labels, "get", "device"], stats.num_served_tokens * token_bytes)
            moved.add_metric([*labels, "migrate", "device"], self._node.migrated_bytes(cache_id))
            used["device"] += stats.bytes_resident
            for tier, nbytes in self._add_lower_tiers(labels, hosted, counters, gauges).items():
                used[tier] += nbytes
        yield from counters.values()
        yield from gauges.values()
        yield from self._node.collect(used)
        yield from _network_store_figures(self._registry.network_store)

    @staticmethod
    def _add_lower_tiers(labels: list[str], hosted, counters: dict, gauges: dict) -> dict[str, int]:
        lower = hosted.engine.tiers
        resident = lower.resident_bytes() if lower is not None else {}
        failures = lower.checksum_failures() if lower is not None else {}
        moved = lower.bytes_moved() if lower is not None else {}
        for tier in LOWER_TIERS:
            gauges["resident_bytes"].add_metric([*labels, tier], resident.get(tier, 0))
            gauges["capacity_bytes"].add_metric([*labels, tier], hosted.capacity.get(tier, 0))
            counters["checksum_failures"].add_metric([*labels, tier], failures.get(tier, 0))
            for op in ("put", "get"):
                counters["bytes_moved"].add_metric([*labels, op, tier], moved.get((op, tier), 0))
        return {tier: resident.get(tier, 0) for tier in LOWER_TIERS}


def _network_store_figures(store):
    """The node's client of the fleet's network store: whether it answers now, and its faults and skipped calls
    (nothing when the node has no network store)."""
    if store is None:
        return
    healthy = GaugeMetricFamily(
        "kcaas_node_network_store_healthy", "1 while the network store answers this node, 0 while its breaker is open"
    )
    healthy.add_metric([], 1 if store.healthy else 0)
    faults = CounterMetricFamily("kcaas_node_network_store_faults", "Network store calls that timed out or failed")
    faults.add_metric([], store.num_faults)
    skipped = CounterMetricFamily(
        "kcaas_node_network_store_skipped", "Network store calls answered as misses while the store was down"
    )
    skipped.add_metric([], store.num_skipped)
    yield from (healthy, faults, skipped)


class NodeFigures:
    """Node-wide figures: capacity per tier (what the agent offers), the heartbeat's age, migrated bytes per cache.
    The heartbeat and the migration target report here; the collector reads it at scrape time."""

    def __init__(self, capacity: dict[str, int], clock=time.monotonic):
        self.capacity = {tier: int(capacity.get(tier, 0)) for tier in TIERS}
        self._clock = clock
        self._lock = threading.Lock()
        self._last_heartbeat = clock()  # before the first heartbeat: the age counts from the agent's start
        self._migrated: dict[str, int] = {}

    def heartbeat_succeeded(self) -> None:
        self._last_heartbeat = self._clock()

    def count_migrated(self, cache_id: str, nbytes: int) -> None:
        with self._lock:
            self._migrated[cache_id] = self._migrated.get(cache_id, 0) + nbytes

    def migrated_bytes(self, cache_id: str) -> int:
        with self._lock:
            return self._migrated.get(cache_id, 0)

    def collect(self, used: dict[str, int]):
        total = GaugeMetricFamily("kcaas_node_capacity_bytes", "Bytes this node offers per tier", labels=["tier"])
        in_use = GaugeMetricFamily("kcaas_node_used_bytes", "Bytes resident per tier, all caches", labels=["tier"])
        for tier in TIERS:
            total.add_metric([tier], self.capacity[tier])
            in_use.add_metric([tier], used.get(tier, 0))
        age = GaugeMetricFamily(
            "kcaas_node_heartbeat_age_seconds",
            "Seconds since the last heartbeat the control plane accepted (before the first: since the agent started)",
        )
        age.add_metric([], max(0.0, self._clock() - self._last_heartbeat))
        yield from (total, in_use, age)


def build_version() -> str:
    """The installed kcaas distribution's version (what `pip show kcaas` says), or `unknown` outside an install."""
    try:
        return importlib.metadata.version("kcaas")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class BuildInfoCollector:
    """`kcaas_build_info{version=...} 1`: which build this process runs (join on it: `* on(instance) group_left`)."""

    def collect(self):
        info = GaugeMetricFamily("kcaas_build_info", "Always 1; the version of the running build", labels=["version"])
        info.add_metric([build_version()], 1)
        yield info


class LatencyHistogram:
    """A latency observed into `name` (`*_duration_seconds`, Prometheus' convention) and into `deprecated`, its
    old name, kept for one release so that dashboards that read it keep working (its HELP says it is deprecated)."""

    def __init__(self, name: str, deprecated: str, documentation: str, labelnames, **options):
        self.current = Histogram(name, documentation, labelnames, **options)
        self.deprecated = Histogram(deprecated, f"Deprecated, use {name}: {documentation}", labelnames, **options)

    def labels(self, **labels) -> _Both:
        """The labelled children of both histograms, observed together."""
        return _Both(self.current.labels(**labels), self.deprecated.labels(**labels))


class _Both:
    def __init__(self, *children):
        self._children = children

    def observe(self, seconds: float) -> None:
        for child in self._children:
            child.observe(seconds)


class NodeMetrics:
    """The metrics registry of one agent: engine counters plus the data plane's own events."""

    def __init__(self, cache_registry: CacheRegistry, capacity: dict[str, int] | None = None):
        """`capacity`: the bytes the node offers per tier (the agent's config); device defaults to the registry's."""
        self.registry = CollectorRegistry()
        self.node = NodeFigures(capacity or {"device": cache_registry.device_capacity_bytes})
        self.registry.register(CacheStatsCollector(cache_registry, self.node))
        self.registry.register(BuildInfoCollector())
        self.request_seconds = LatencyHistogram(
            "kcaas_dataplane_request_duration_seconds",
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
