"""kcaas.Client against the real control plane: pytest-django's live_server (the project's WSGI app on a real socket,
real PostgreSQL, real Redis rate limiter) and, for provisioning, two real Celery workers in threads on the real
broker: the control plane's on `control` and the minimal node agent of tests/caches/node_consumer.py on the node's
queue (as tests/caches/test_provisioning_integration.py runs them)."""

import time
import uuid

import pytest
from celery import bootsteps
from celery.contrib.testing.worker import start_worker
from celery.signals import task_postrun
from celery.worker import state as worker_state
from django.db import connections

import kcaas
from controlplane.celery import app as control_app, node_queue
from fleet.models import Node
from tests.caches import node_consumer
from tests.caches.conftest import make_node, make_tenant, purge_node_queue  # noqa: F401 - fixtures reused

# The workers outlive each test, so the node they serve keeps one id (its own, distinct from the caches tests').
NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-0000005d4c11")


def _close_thread_connections(**kwargs) -> None:
    connections.close_all()


def _stop_together(*workers, timeout=15.0) -> None:
    worker_state.should_terminate = 0
    deadline = time.monotonic() + timeout
    while any(w.blueprint.state == bootsteps.RUN for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def workers():
    task_postrun.connect(_close_thread_connections, weak=False)
    options = {"perform_ping_check": False, "shutdown_timeout": 20, "use_eventloop": False}
    try:
        with start_worker(control_app, queues=["control"], **options) as control_worker:
            with start_worker(node_consumer.node_app, queues=[node_queue(NODE_ID)], **options) as node_worker:
                yield node_consumer.behaviour
                _stop_together(control_worker, node_worker)
    finally:
        task_postrun.disconnect(_close_thread_connections)
        control_app.set_current()
        control_app.set_default()
        purge_node_queue(NODE_ID)


@pytest.fixture
def node(make_node, workers):  # noqa: F811
    """A registered node (8 GiB device) with the id the node worker serves; the consumer told to succeed."""
    made = make_node()
    Node.objects.filter(pk=made.pk).update(id=NODE_ID)
    made = Node.objects.get(pk=NODE_ID)
    behaviour = node_consumer.behaviour
    with behaviour.lock:
        behaviour.node_id, behaviour.endpoint = str(made.pk), made.endpoint
        behaviour.fail_reason, behaviour.received = None, []
    return made


@pytest.fixture
def sdk(live_server):
    """sdk(raw_key, **options) -> a kcaas.Client on the live server; all are closed after the test."""
    made = []

    def make(raw_key: str, **options) -> kcaas.Client:
        client = kcaas.Client(live_server.url, raw_key, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
