"""deploy/prometheus and deploy/grafana hold what the code exports: every alert rule and every dashboard panel reads
metric names that a live control plane (the real /metrics over HTTP) and a real node agent process (its metrics port)
actually expose, and the rules carry what an on-call needs (for, severity, summary). promtool checks the files too
when it is installed (Debian's `prometheus` package)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.caches.conftest import BLOCK_BYTES, attach_body, make_tenant, wait_for_state  # noqa: F401 - fixtures
from tests.caches.test_node_agent_process import agent_process, control_worker  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
METRIC = re.compile(r"\bkcaas_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def series_names(text: str) -> set[str]:
    """The series names an exposition defines, families without samples yet included (from their TYPE lines)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


@pytest.fixture
def network_store_env(network_store, monkeypatch):
    """The agent under test gets the fleet's network store (its client's metrics are exported only then)."""
    for name, value in network_store.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def exported(network_store_env, agent_process, live_server, make_tenant):
    """Every series name the live control plane and the live node agent (hosting one cache) expose."""
    _, _, metrics_port = agent_process
    tenant = make_tenant()
    attached = tenant.client.post("/api/v1/caches", attach_body(device=16 * BLOCK_BYTES), format="json")
    assert attached.status_code == 201, attached.content
    wait_for_state(tenant.client, attached.json()["id"], "ready")
    node = read(f"http://127.0.0.1:{metrics_port}/metrics")
    control = read(f"{live_server.url}/metrics")
    assert "kcaas_node_heartbeat_age_seconds" in node and "kcaas_http_requests" in control
    return series_names(node) | series_names(control)


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def panel_exprs() -> list[tuple[str, str, str]]:
    found = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            found.extend((path.name, panel["title"], target["expr"]) for target in panel["targets"])
    return found


def test_every_alert_has_what_on_call_needs():
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    for wanted in ("KCaaSNodeLost", "KCaaSNodeHeartbeatStale", "KCaaSChecksumFailures", "KCaaSHitRateDrop"):
        assert wanted in names
    assert {"KCaaSBillingRollupLag", "KCaaSAuditUnavailable"} <= names
    for rule in rules:
        assert rule["expr"].strip() and "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in {"page", "critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]


def test_dashboards_are_grafana_models_on_a_prometheus_datasource_variable():
    assert {path.stem for path in DASHBOARDS} == {"fleet", "tenant", "node"}
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert dashboard["uid"] and dashboard["panels"], path.name
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
            assert panel["targets"], (path.name, panel["title"])


def test_the_scrape_config_names_both_jobs_and_the_rules():
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kcaas-control-plane", "kcaas-control-worker", "kcaas-nodes"}
    assert jobs["kcaas-control-plane"]["authorization"]["type"] == "Bearer"


def test_alerts_and_panels_read_only_metrics_the_code_exports(exported):
    expressions = [(f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules()]
    expressions += [(f"{name}: {title}", expr) for name, title, expr in panel_exprs()]
    for where, expr in expressions:
        used = set(METRIC.findall(expr))
        assert used or re.search(r"\bup\{", expr), f"{where} reads no KCaaS metric: {expr}"
        assert used <= exported, f"{where} reads metrics nothing exports: {sorted(used - exported)}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt: prometheus)")
def test_promtool_accepts_the_rules_and_the_config_and_the_rule_tests_pass():
    commands = (
        ["check", "rules", ALERTS.name],
        ["check", "config", "--syntax-only", SCRAPE_CONFIG.name],
        ["test", "rules", "alerts_test.yml"],  # the alerts fire on the series they should (promtool's unit tests)
    )
    for command in commands:
        result = subprocess.run(["promtool", *command], capture_output=True, text=True, timeout=60, cwd=ALERTS.parent)
        assert result.returncode == 0, result.stdout + result.stderr
