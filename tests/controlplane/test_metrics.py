"""GET /metrics: the Prometheus exposition of the control plane, read through the real middleware, services, Celery
tasks (run in process) and broker. Labels are bounded (route names, status codes, error codes), nothing names a
tenant, and access needs the bearer token when one is set, loopback otherwise."""

from __future__ import annotations

import urllib.request
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from billing import tasks as billing_tasks
from caches import tasks as caches_tasks
from controlplane.metrics import queue_depth
from core.metrics import CELERY_TASKS, serve_worker_metrics
from fleet.models import Node
from tests.caches.conftest import attach_body, free_port, make_node, make_tenant  # noqa: F401 - fixtures

URL = "/api/v1/caches"


def scrape(client: Client | None = None, **headers) -> dict[tuple[str, tuple], float]:
    response = (client or Client()).get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_request_is_counted_and_timed_by_its_route_name(db):
    before = scrape()
    assert Client().get("/healthz").status_code == 200
    after = scrape()
    timed = "kcaas_http_request_seconds_count"
    assert value(after, timed, route="healthz", method="GET") == value(before, timed, route="healthz", method="GET") + 1
    counted = ("kcaas_http_requests_total", {"route": "healthz", "method": "GET", "status": "200"})
    assert value(after, counted[0], **counted[1]) == value(before, counted[0], **counted[1]) + 1


def test_labels_are_bounded_never_the_raw_path(db):
    secret_path = f"/no-such-page-{uuid.uuid4().hex}"
    assert Client().get(secret_path).status_code == 404
    cache_path = f"{URL}/{uuid.uuid4()}"
    Client().get(cache_path)  # a matched pattern, refused (no credentials): labelled by the pattern's name
    samples = scrape()
    text = repr(samples)
    assert secret_path not in text and cache_path not in text
    assert value(samples, "kcaas_http_requests_total", route="unmatched", method="GET", status="404") >= 1
    routes = {dict(labels).get("route") for name, labels in samples if name == "kcaas_http_requests_total"}
    assert all(route and "/" not in route for route in routes), routes
    assert not [name for name, _ in samples if name.endswith("_created")]


def test_attach_outcomes_placement_failures_and_audit_writes(make_tenant, make_node):
    tenant = make_tenant()
    before = scrape()
    refused = tenant.client.post(URL, attach_body("no-room"), format="json")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_capacity"
    make_node()
    attached = tenant.client.post(URL, attach_body("room"), format="json")
    assert attached.status_code == 201, attached.content
    after = scrape()

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("kcaas_cache_attaches_total", outcome="no_capacity") == 1
    assert grew("kcaas_cache_attaches_total", outcome="ok") == 1
    assert grew("kcaas_placement_failures_total", reason="no_capacity") == 1
    assert grew("kcaas_audit_write_seconds_count") >= 1  # CACHE_ATTACHED at least
    assert grew("kcaas_http_requests_total", route="caches", method="POST", status="201") == 1
    assert str(tenant.tenant.pk) not in repr(after)  # no tenant id in any label


def test_lease_expiries_task_outcomes_and_billing_rollup(make_node, django_capture_on_commit_callbacks):
    node = make_node()
    before = scrape()
    Node.objects.filter(pk=node.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):  # an expiry is counted once the sweep commits
        caches_tasks.sweep_leases.apply().get()
    billing_tasks.rollup.apply().get()
    after = scrape()
    assert value(after, "kcaas_node_lease_expiries_total") == value(before, "kcaas_node_lease_expiries_total") + 1
    for task in ("caches.sweep_leases", "billing.rollup"):
        labels = {"task": task, "outcome": "success"}
        name = "kcaas_celery_tasks_total"
        assert value(after, name, **labels) == value(before, name, **labels) + 1
    rolled_up = value(after, "kcaas_billing_last_rollup_timestamp_seconds")
    assert abs(rolled_up - timezone.now().timestamp()) < 60


def test_the_control_queue_depth_is_read_from_the_broker(db):
    from core.celery import app

    depth = ("kcaas_celery_queue_depth", (("queue", "control"),))
    with app.connection_for_write() as connection:
        connection.default_channel.queue_purge("control")  # this test's own broker (CELERY_BROKER_URL)
        try:
            assert scrape()[depth] == 0
            for _ in range(3):  # waiting messages, with no worker to take them
                app.send_task("caches.sweep_leases", queue="control", connection=connection)
            samples = scrape()
            assert samples[depth] == 3 and value(samples, "kcaas_celery_broker_up") == 1
        finally:
            connection.default_channel.queue_purge("control")


def test_the_embedded_file_broker_counts_its_queue_folder(tmp_path):
    from celery import Celery

    from kcaas.node_protocol import broker as fs_broker

    app = Celery("depth", broker=fs_broker.URL)
    app.conf.broker_transport_options = fs_broker.folder_options(tmp_path / "celery")
    assert queue_depth("control", app) == 0
    with app.connection_for_write() as connection:
        for _ in range(2):
            app.send_task("caches.sweep_leases", queue="control", connection=connection)
    assert queue_depth("control", app) == 2


def test_a_token_is_required_when_set(db, settings):
    settings.KCAAS_METRICS_TOKEN = "scrape-secret"
    refused = Client().get("/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "metrics_unauthorized"
    wrong = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer nope")
    assert wrong.status_code == 401
    scrape(HTTP_AUTHORIZATION="Bearer scrape-secret")
    assert b"scrape-secret" not in Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret").content


@pytest.mark.parametrize("remote", ["10.0.0.5", "192.168.1.20"])
def test_without_a_token_only_loopback_may_scrape(db, settings, remote):
    settings.KCAAS_METRICS_TOKEN = ""
    refused = Client(REMOTE_ADDR=remote).get("/metrics")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "metrics_forbidden"
    scrape(Client(REMOTE_ADDR="127.0.0.1"))


@pytest.mark.django_db(transaction=True)
def test_a_database_outage_does_not_fail_the_scrape():
    """The last usage report's age is left out while the database refuses connections; the rest is served."""
    from django.db import connection

    assert ("kcaas_billing_usage_report_age_seconds", ()) not in scrape()  # no report yet: no sample either
    connection.close()
    port = connection.settings_dict["PORT"]
    connection.settings_dict["PORT"] = free_port()  # nothing listens there: every connection is refused
    try:
        samples = scrape()
        assert value(samples, "kcaas_celery_broker_up") == 1
        assert ("kcaas_billing_usage_report_age_seconds", ()) not in samples
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port


def test_a_worker_serves_its_own_metrics_on_its_port(db, monkeypatch):
    """A Celery worker in its own container (no shared PROMETHEUS_MULTIPROC_DIR) exposes its task outcomes itself."""
    assert serve_worker_metrics() is None  # no port: nothing served
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("KCAAS_WORKER_METRICS_PORT", str(free_port()))
    server = serve_worker_metrics()
    try:
        CELERY_TASKS.labels(task="billing.rollup", outcome="success").inc()
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'kcaas_celery_tasks_total{outcome="success",task="billing.rollup"}' in body
    finally:
        server.shutdown()
        server.server_close()


def test_only_get_reads_metrics(db):
    response = Client().post("/metrics")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def _families(body: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(body)}


def test_latencies_are_duration_seconds_histograms_and_the_old_names_are_kept_deprecated(db):
    Client().get("/healthz")
    families = _families(Client().get("/metrics").content.decode())
    for current, old in (
        ("kcaas_http_request_duration_seconds", "kcaas_http_request_seconds"),
        ("kcaas_audit_write_duration_seconds", "kcaas_audit_write_seconds"),
    ):
        assert families[current].type == families[old].type == "histogram"
        assert families[old].documentation.startswith(f"Deprecated, use {current}")
        assert "deprecated" not in families[current].documentation.lower()
    after = scrape()
    for name in ("kcaas_http_request_duration_seconds_count", "kcaas_http_request_seconds_count"):
        assert value(after, name, route="healthz", method="GET") >= 1
    histograms = [name for name, family in families.items() if family.type == "histogram"]
    assert all(name.endswith("_seconds") for name in histograms), histograms


def test_the_control_plane_and_a_worker_export_their_build_info(db, monkeypatch):
    from importlib.metadata import version

    expected = (("version", version("kcaas")),)
    assert scrape()[("kcaas_build_info", expected)] == 1.0
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("KCAAS_WORKER_METRICS_PORT", str(free_port()))
    server = serve_worker_metrics()
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5).read()
        [sample] = _families(body.decode())["kcaas_build_info"].samples
        assert sample.labels == dict(expected) and sample.value == 1.0
    finally:
        server.shutdown()
        server.server_close()
