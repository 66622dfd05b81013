"""scripts/render_dashboard.py's PromQL subset: exact values on known scrapes, and every query of the three
dashboards inside the subset (a query it cannot evaluate would be a panel silently missing from the rendering)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_dashboard", REPO / "scripts" / "render_dashboard.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def scrapes() -> list[tuple[float, list]]:
    """Two scrapes 10 s apart of two nodes and one control plane."""
    a, b = {"instance": "n1"}, {"instance": "n2"}
    first = [
        ("kcaas_cache_hit_tokens_total", {**a, "cache": "c1"}, 100.0),
        ("kcaas_cache_hit_tokens_total", {**b, "cache": "c2"}, 50.0),
        ("kcaas_cache_miss_tokens_total", {**a, "cache": "c1"}, 100.0),
        ("kcaas_node_used_bytes", {**a, "tier": "device"}, 10.0),
        ("kcaas_node_used_bytes", {**b, "tier": "device"}, 30.0),
        ("kcaas_http_request_duration_seconds_bucket", {"route": "caches", "le": "0.1"}, 0.0),
        ("kcaas_http_request_duration_seconds_bucket", {"route": "caches", "le": "0.5"}, 0.0),
        ("kcaas_http_request_duration_seconds_bucket", {"route": "caches", "le": "+Inf"}, 0.0),
        ("kcaas_billing_last_rollup_timestamp_seconds", {}, 990.0),
    ]
    second = [
        ("kcaas_cache_hit_tokens_total", {**a, "cache": "c1"}, 160.0),
        ("kcaas_cache_hit_tokens_total", {**b, "cache": "c2"}, 70.0),
        ("kcaas_cache_miss_tokens_total", {**a, "cache": "c1"}, 120.0),
        ("kcaas_node_used_bytes", {**a, "tier": "device"}, 10.0),
        ("kcaas_node_used_bytes", {**b, "tier": "device"}, 30.0),
        ("kcaas_http_request_duration_seconds_bucket", {"route": "caches", "le": "0.1"}, 50.0),
        ("kcaas_http_request_duration_seconds_bucket", {"route": "caches", "le": "0.5"}, 100.0),
        ("kcaas_http_request_duration_seconds_bucket", {"route": "caches", "le": "+Inf"}, 100.0),
        ("kcaas_billing_last_rollup_timestamp_seconds", {}, 990.0),
    ]
    return [(1000.0, first), (1010.0, second)]


@pytest.fixture
def evaluator():
    return render.Evaluator(scrapes())


def test_rate_increase_and_sums(evaluator):
    assert evaluator.at("sum(rate(kcaas_cache_hit_tokens_total[5m]))", 1) == {(): 8.0}  # (60 + 20) / 10 s
    by_instance = evaluator.at("sum by (instance) (increase(kcaas_cache_hit_tokens_total[1h]))", 1)
    assert by_instance == {(("instance", "n1"),): 60.0, (("instance", "n2"),): 20.0}
    assert evaluator.at('sum by (tier) (kcaas_node_used_bytes{instance=~"n.*"})', 0) == {(("tier", "device"),): 40.0}


def test_the_fleet_hit_rate_expression(evaluator):
    hits = "sum(rate(kcaas_cache_hit_tokens_total[5m]))"
    misses = "sum(rate(kcaas_cache_miss_tokens_total[5m]))"
    assert evaluator.at(f"{hits} / clamp_min({hits} + {misses}, 1)", 1) == {(): 0.8}  # 8 / (8 + 2)


def test_histogram_quantile_interpolates_inside_the_bucket(evaluator):
    p95 = "histogram_quantile(0.95, sum by (le, route) (rate(kcaas_http_request_duration_seconds_bucket[5m])))"
    [(labels, value)] = evaluator.at(p95, 1).items()
    assert labels == (("route", "caches"),)
    assert value == pytest.approx(0.1 + 0.4 * 0.9)  # rank 9.5 of 10/s, 5/s below 0.1, 5/s in (0.1, 0.5]


def test_time_arithmetic(evaluator):
    assert evaluator.at("time() - kcaas_billing_last_rollup_timestamp_seconds", 1) == {(): 20.0}


@pytest.mark.parametrize("name", ["fleet", "tenant", "node"])
def test_every_dashboard_query_is_inside_the_subset(name, evaluator):
    dashboard = json.loads((REPO / "deploy" / "grafana" / f"{name}.json").read_text())
    for panel in dashboard["panels"]:
        series = render.panel_series(panel, evaluator)  # raises ValueError for a query outside the subset
        svg = render.svg_panel(panel, series, 1000.0, 1010.0)
        assert svg.startswith("<svg") and panel["title"].split()[0] in svg
