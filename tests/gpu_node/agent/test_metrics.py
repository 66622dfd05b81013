import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_node.agent.metrics import NodeFigures, NodeMetrics
from gpu_node.agent.registry import CacheRegistry
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

SPEC = tiny_spec(block_size=4)


def test_engine_counters_are_exported_per_cache_at_scrape_time():
    registry = CacheRegistry(device_capacity_bytes=64 * SPEC.block_bytes, device="cpu")
    hosted = registry.provision(
        cache_id="c1", spec=SPEC, capacity={"device": 8 * SPEC.block_bytes}, hash_key=b"k" * 32, epoch=1
    )
    tokens = list(range(6))
    hosted.engine.put(tokens, prefix_kv(SPEC, tokens))
    hosted.engine.get(tokens + [9, 9])
    metrics = NodeMetrics(registry)
    metrics.request_seconds.labels(op="get").observe(0.002)
    metrics.auth_failures.labels(reason="token_expired").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'kcaas_cache_hit_tokens_total{cache="c1",tenant=""} 6.0' in text
    assert 'kcaas_cache_miss_tokens_total{cache="c1",tenant=""} 2.0' in text
    assert f'kcaas_cache_resident_bytes{{cache="c1",tenant="",tier="device"}} {2 * SPEC.block_bytes}.0' in text
    assert 'kcaas_dataplane_request_seconds_count{op="get"} 1.0' in text
    assert 'kcaas_dataplane_auth_failures_total{reason="token_expired"} 1.0' in text
    assert 'kcaas_cache_hit_tokens_total{cache="c1",tenant=""}' in text  # provisioned without a tenant id


def test_metrics_are_served_over_http():
    registry = CacheRegistry(device_capacity_bytes=SPEC.block_bytes * 8, device="cpu")
    server, thread = NodeMetrics(registry).serve(0)
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kcaas_dataplane_request_seconds" in body
    finally:
        server.shutdown()


TENANT = "7d0c7a52-5f4e-4a8e-9d3f-0a6f1c3e2b11"


def samples_of(metrics: NodeMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def tiered_registry():
    """A node with 16 device blocks hosting one tenant's cache of 4 device blocks and 8 DRAM blocks."""
    registry = CacheRegistry(device_capacity_bytes=16 * SPEC.block_bytes, device="cpu")
    capacity = {"device": 4 * SPEC.block_bytes, "dram": 8 * SPEC.block_bytes}
    hosted = registry.provision(
        cache_id="c1", spec=SPEC, capacity=capacity, hash_key=b"k" * 32, epoch=1, tenant_id=TENANT
    )
    return registry, hosted


def test_cache_series_carry_the_tenant_label_and_bytes_moved_per_op_and_tier():
    registry, hosted = tiered_registry()
    first, second = list(range(100, 116)), list(range(500, 516))  # 4 blocks each: the device pool's size
    hosted.engine.put(first, prefix_kv(SPEC, first))
    hosted.engine.put(second, prefix_kv(SPEC, second))  # `first` is demoted to DRAM
    assert hosted.engine.get(first)[0] == 16  # promoted back from DRAM
    metrics = NodeMetrics(registry)
    metrics.node.count_migrated("c1", 3 * SPEC.block_bytes)
    samples = samples_of(metrics)

    def moved(op, tier):
        return samples[
            ("kcaas_node_bytes_moved_total", (("cache", "c1"), ("op", op), ("tenant", TENANT), ("tier", tier)))
        ]

    assert moved("put", "device") == 32 * SPEC.block_bytes // SPEC.block_size  # 32 tokens stored
    assert moved("put", "dram") == 4 * SPEC.block_bytes + 4 * SPEC.block_bytes  # first, then second pushed out
    assert moved("get", "dram") == 4 * SPEC.block_bytes
    assert moved("put", "ssd") == moved("get", "ssd") == 0
    assert moved("migrate", "device") == 3 * SPEC.block_bytes
    assert samples[("kcaas_cache_hit_tokens_total", (("cache", "c1"), ("tenant", TENANT)))] == 16
    per_cache = [labels for name, labels in samples if name.startswith("kcaas_cache_")]
    assert per_cache and all(("tenant", TENANT) in labels for labels in per_cache)


def test_node_capacity_and_use_per_tier():
    registry, hosted = tiered_registry()
    tokens = list(range(8))
    hosted.engine.put(tokens, prefix_kv(SPEC, tokens))
    capacity = {"device": 16 * SPEC.block_bytes, "dram": 64 * SPEC.block_bytes, "ssd": 0}
    samples = samples_of(NodeMetrics(registry, capacity))
    for tier, nbytes in capacity.items():
        assert samples[("kcaas_node_capacity_bytes", (("tier", tier),))] == nbytes
    assert samples[("kcaas_node_used_bytes", (("tier", "device"),))] == 2 * SPEC.block_bytes
    assert samples[("kcaas_node_used_bytes", (("tier", "dram"),))] == 0
    default = samples_of(NodeMetrics(registry))  # without the agent's figures: the registry's device bytes
    assert default[("kcaas_node_capacity_bytes", (("tier", "device"),))] == 16 * SPEC.block_bytes


def test_heartbeat_age_counts_from_the_last_accepted_heartbeat():
    now = [1000.0]
    figures = NodeFigures({"device": 1}, clock=lambda: now[0])

    def age() -> float:
        (family,) = [f for f in figures.collect({}) if f.name == "kcaas_node_heartbeat_age_seconds"]
        return family.samples[0].value

    now[0] += 7.5
    assert age() == 7.5  # before the first heartbeat: since the agent started
    figures.heartbeat_succeeded()
    now[0] += 2.0
    assert age() == 2.0


def test_no_created_series_are_exported():
    registry, _ = tiered_registry()
    metrics = NodeMetrics(registry)
    metrics.request_seconds.labels(op="get").observe(0.001)
    metrics.auth_failures.labels(reason="token_expired").inc()
    names = {name for name, _ in samples_of(metrics)}
    assert "kcaas_dataplane_auth_failures_total" in names
    assert not [name for name in names if name.endswith("_created")]


def _families_scraped(metrics: NodeMetrics) -> dict:
    server, _thread = metrics.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5).read()
    finally:
        server.shutdown()
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def test_latency_is_a_duration_seconds_histogram_and_the_old_name_is_kept_deprecated():
    metrics = NodeMetrics(CacheRegistry(device_capacity_bytes=SPEC.block_bytes * 8, device="cpu"))
    metrics.request_seconds.labels(op="get").observe(0.002)
    families = _families_scraped(metrics)
    current, old = families["kcaas_dataplane_request_duration_seconds"], families["kcaas_dataplane_request_seconds"]
    assert current.type == old.type == "histogram"
    assert "deprecated" not in current.documentation.lower()
    assert old.documentation.startswith("Deprecated, use kcaas_dataplane_request_duration_seconds")
    for family in (current, old):
        counts = [s for s in family.samples if s.name.endswith("_count")]
        assert [(s.labels, s.value) for s in counts] == [({"op": "get"}, 1.0)]
    latencies = [name for name, f in families.items() if f.type == "histogram"]
    assert all(name.endswith("_seconds") for name in latencies), latencies


def test_the_agent_exports_its_build_info():
    from importlib.metadata import version

    families = _families_scraped(NodeMetrics(CacheRegistry(device_capacity_bytes=SPEC.block_bytes, device="cpu")))
    [sample] = families["kcaas_build_info"].samples
    assert sample.labels == {"version": version("kcaas")} and sample.value == 1.0
