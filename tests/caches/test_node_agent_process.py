"""The node agent as a real process (python -m gpu_node.agent) against the real control plane (live server on
PostgreSQL, the control queue's worker on Redis): it registers, provisions through its own in-process worker,
heartbeats resident bytes, and stops cleanly on SIGTERM."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from core.celery import app as control_app
from fleet import services as fleet_services
from fleet.models import Node
from tests.caches.conftest import BLOCK_BYTES, attach_body, free_port, purge_node_queue, running_workers, wait_for_state

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def control_worker():
    with running_workers((control_app, ["control"])) as (worker,):
        yield worker


@pytest.fixture
def agent_process(live_server, settings, control_worker):
    settings.KCAAS_NODE_HEARTBEAT_SECONDS = 1
    issued = fleet_services.node_create(name="agent-under-test")
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "KCAAS_CONTROL_URL": live_server.url,
        "KCAAS_NODE_CREDENTIAL": issued.credential,
        "KCAAS_NODE_ENDPOINT": "127.0.0.1:7301",
        "KCAAS_NODE_DEVICE_BYTES": str(64 * BLOCK_BYTES),
        "KCAAS_NODE_TORCH_DEVICE": "cpu",
        "LOG_LEVEL": "WARNING",
        "KCAAS_NODE_METRICS_PORT": str(free_port()),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "gpu_node.agent"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        if "ready" not in line:
            process.kill()
            pytest.fail(f"agent did not start: {line!r} {process.stderr.read()[-3000:]}")
        yield process, issued.node.pk, int(env["KCAAS_NODE_METRICS_PORT"])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        purge_node_queue(issued.node.pk)


def test_the_agent_registers_provisions_heartbeats_and_stops_on_sigterm(agent_process, tenant_a):
    process, node_id, metrics_port = agent_process
    node = Node.objects.get(pk=node_id)
    assert (
        node.state == "ready" and node.endpoint == "127.0.0.1:7301" and node.device_capacity_bytes == 64 * BLOCK_BYTES
    )

    response = tenant_a.client.post("/api/v1/caches", attach_body(device=16 * BLOCK_BYTES), format="json")
    assert response.status_code == 201
    ready = wait_for_state(tenant_a.client, response.json()["id"], "ready")
    assert ready["endpoint"] == "127.0.0.1:7301"

    first_beat = Node.objects.get(pk=node_id).last_heartbeat_at
    deadline = time.monotonic() + 10
    while Node.objects.get(pk=node_id).last_heartbeat_at == first_beat:
        assert time.monotonic() < deadline, "no heartbeat within 10 s at a 1 s interval"
        time.sleep(0.1)

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    series = f'kcaas_cache_capacity_bytes{{cache="{ready["id"]}",tenant="{tenant_a.tenant.pk}",tier="device"}}'
    assert series in metrics

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
