import urllib.request

from prometheus_client import generate_latest

from gpu_node.metrics import NodeMetrics
from gpu_node.registry import CacheRegistry

from .kv_fixtures import prefix_kv, tiny_spec

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
    assert 'kcaas_cache_hit_tokens_total{cache="c1"} 6.0' in text
    assert 'kcaas_cache_miss_tokens_total{cache="c1"} 2.0' in text
    assert f'kcaas_cache_resident_bytes{{cache="c1",tier="device"}} {2 * SPEC.block_bytes}.0' in text
    assert 'kcaas_dataplane_request_seconds_count{op="get"} 1.0' in text
    assert 'kcaas_dataplane_auth_failures_total{reason="token_expired"} 1.0' in text
    assert "tenant" not in text  # labelled by cache, never by tenant


def test_metrics_are_served_over_http():
    registry = CacheRegistry(device_capacity_bytes=SPEC.block_bytes * 8, device="cpu")
    server, thread = NodeMetrics(registry).serve(0)
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kcaas_dataplane_request_seconds" in body
    finally:
        server.shutdown()
