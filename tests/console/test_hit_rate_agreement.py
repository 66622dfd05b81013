"""The console's hit rate and the fleet dashboard's are one figure from one source: the node engines' hit and miss
token counters since each cache's placement, read by the console from the nodes' heartbeats and by the dashboard
from the nodes' /metrics. Two scrapes with no traffic between them are where a windowed rate read 0% (the console
read 75%)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_node.agent.metrics import NodeMetrics
from gpu_node.agent.registry import CacheRegistry
from tests.console.nodes_fixtures import heartbeat, make_node
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec
from tests.test_render_dashboard import render

pytestmark = pytest.mark.django_db
FLEET = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fleet.json"


def _agent_with_traffic(hits_wanted: int) -> CacheRegistry:
    """A node's cache registry whose one cache was read: `hits_wanted` rounds of 6 cached and 2 uncached tokens."""
    spec = tiny_spec(block_size=4)
    registry = CacheRegistry(device_capacity_bytes=64 * spec.block_bytes, device="cpu")
    hosted = registry.provision(
        cache_id=str(uuid.uuid4()), spec=spec, capacity={"device": 8 * spec.block_bytes}, hash_key=b"k" * 32, epoch=1
    )
    tokens = list(range(6))
    hosted.engine.put(tokens, prefix_kv(spec, tokens))
    for _ in range(hits_wanted):
        hosted.engine.get(tokens + [9, 9])
    return registry


def _scrape(registry: CacheRegistry, instance: str) -> list[tuple[str, dict, float]]:
    text = generate_latest(NodeMetrics(registry).registry).decode()
    families = text_string_to_metric_families(text)
    return [(s.name, {**s.labels, "instance": instance}, s.value) for family in families for s in family.samples]


def _dashboard_hit_rate(history: list) -> float:
    [panel] = [p for p in json.loads(FLEET.read_text())["panels"] if "hit rate" in p["title"].lower()]
    [(labels, value)] = render.Evaluator(history).at(panel["targets"][0]["expr"], len(history) - 1).items()
    return value


def test_the_dashboard_and_the_console_show_the_same_hit_rate(operator_client):
    agents = {"n1": _agent_with_traffic(3), "n2": _agent_with_traffic(1)}
    for name, registry in agents.items():
        heartbeat(make_node(name), registry.resident_snapshot())
    scrape = [row for name, registry in agents.items() for row in _scrape(registry, name)]
    history = [(1000.0, scrape), (1015.0, scrape)]  # idle between the two scrapes

    console = re.search(r'id="hit-rate">([0-9.]+)%<', operator_client.get("/console/").content.decode())
    assert console is not None and float(console.group(1)) == 75.0  # 24 hits of 32 tokens asked
    assert _dashboard_hit_rate(history) * 100 == pytest.approx(float(console.group(1)))
