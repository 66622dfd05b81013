"""The broker goes away while tenants attach and detach, against the real service: the live server, the control
queue's Celery worker, Celery beat (a process: it drives the outbox's dispatcher and the reconciler) and a node agent
process, all on a private Redis broker that the test stops for a few seconds and starts again.

Every attach still answers 201 at once (the order to the node is a row written with the cache, not a publish in
the request's way); once the broker is back every cache becomes ready, every detach ends detached and the node's
reservation returns to zero: no cache stays provisioning or detaching, nothing is lost or doubled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kcaas
from caches.models import Cache, CacheState
from fleet.models import Node, NodeOrder, OrderState
from tests.control_broker import use_broker
from tests.e2e.conftest import spec_for, tenant_key
from tests.faults import PrivateRedis, start_calls
from tests.waiting import eventually

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(PrivateRedis.available() is not None, reason="needs redis-server"),
]
REPO = Path(__file__).resolve().parents[2]
CACHES = 6
OUTAGE_SECONDS = 4


@pytest.fixture
def private_broker(tmp_path, monkeypatch):
    """The control plane (in process), its worker, beat and the agents all on one private Redis."""
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    monkeypatch.setenv("CELERY_BROKER_URL", server.url)  # the agent and beat processes
    with use_broker(server.url):
        yield server
    server.close()


@pytest.fixture
def beat(private_broker, tmp_path):
    """Celery beat as `make up` runs it, with short outbox periods, sending to the private broker."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'platform'}:{REPO}",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "KCAAS_ORDER_DISPATCH_SECONDS": "0.5",
        "KCAAS_ORDER_RESEND_SECONDS": "2",
        "KCAAS_ORDER_RESEND_MAX_SECONDS": "4",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "beat",
            "--loglevel",
            "warning",
            "--schedule",
            str(tmp_path / "beat-schedule"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield process
    process.terminate()
    process.wait(timeout=15)


def states(ids) -> dict[str, int]:
    counts: dict[str, int] = {}
    for state in Cache.objects.filter(pk__in=ids).values_list("state", flat=True):
        counts[state] = counts.get(state, 0) + 1
    return counts


def all_in(ids, state) -> bool:
    return states(ids) == {state: len(ids)}


def run_during_outage(broker: PrivateRedis, calls) -> list:
    """Run `calls` (no-argument functions) from threads while the broker is stopped for OUTAGE_SECONDS; returns
    their results (or exceptions) in order, once all returned and the broker is back."""
    split = len(calls) // 3
    threads, results = start_calls(calls[:split], daemon=False)
    broker.stop()
    late_threads, late_results = start_calls(calls[split:], daemon=False)
    threads += late_threads
    deadline = time.monotonic() + OUTAGE_SECONDS
    for thread in threads:
        thread.join(max(0.1, deadline - time.monotonic()))
    assert all(not t.is_alive() for t in threads), "a request waited on the broker"
    time.sleep(max(0.0, deadline - time.monotonic()))  # the outage lasts its full length
    broker.start()
    return results + late_results


def test_attaches_and_detaches_during_a_broker_outage_all_finish(private_broker, beat, agent_launcher, model):
    agent = agent_launcher.start()
    spec = spec_for(model)
    client = kcaas.Client(agent_launcher.control_url, tenant_key(), timeout=15)
    capacity = {"device": 8 * spec.block_bytes}

    attached = run_during_outage(
        private_broker, [(lambda i=i: client.attach(f"outage-{i}", spec, capacity, wait=False)) for i in range(CACHES)]
    )
    failures = [r for r in attached if isinstance(r, Exception)]
    assert not failures, failures
    ids = [cache.id for cache in attached]
    assert eventually(lambda: all_in(ids, CacheState.READY), timeout=90), states(ids)

    detached = run_during_outage(private_broker, [(lambda c=c: client.detach(c)) for c in ids])
    assert not [r for r in detached if isinstance(r, Exception)], detached
    assert eventually(lambda: all_in(ids, CacheState.DETACHED), timeout=90), states(ids)
    node = Node.objects.get(pk=agent.node_id)
    assert (node.device_reserved_bytes, node.dram_reserved_bytes, node.ssd_reserved_bytes) == (0, 0, 0)
    assert eventually(
        lambda: (
            not NodeOrder.objects.filter(node=node, state__in=[OrderState.PENDING, OrderState.SENT])
            .exclude(task="kcaas.node.revoke_tokens")
            .exists()
        ),
        timeout=30,
    )
    assert agent.alive
