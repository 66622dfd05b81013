"""kcaas.Client against the real control plane: pytest-django's live_server (the project's WSGI app on a real socket,
real PostgreSQL, real Redis rate limiter) and, for provisioning, two real Celery workers in threads on the real
broker: the control plane's on `control` and the minimal node agent of tests/caches/node_consumer.py on the node's
queue (as tests/caches/test_provisioning_integration.py runs them)."""

import uuid

import pytest

import kcaas
from controlplane.celery import app as control_app, node_queue
from fleet.models import Node
from tests.caches import node_consumer
from tests.waiting import eventually
from tests.caches.conftest import make_node, make_tenant, purge_node_queue, running_workers  # noqa: F401 - fixtures reused

# The workers outlive each test, so the node they serve keeps one id (its own, distinct from the caches tests').
NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-0000005d4c11")


@pytest.fixture(scope="module")
def workers():
    apps = ((control_app, ["control"]), (node_consumer.node_app, [node_queue(NODE_ID)]))
    try:
        with running_workers(*apps):
            yield node_consumer.behaviour
    finally:
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
    yield made
    # The workers outlive the test: let them finish what the test set off (a node's answer still on the control
    # queue, a task in hand) before the database is flushed under them, or the flush deadlocks with their writes.
    assert eventually(workers_idle, timeout=20), "the module's Celery workers did not settle"


def workers_idle() -> bool:
    import os

    import redis
    from celery.worker import state as worker_state

    client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    try:
        queued = client.llen("control") + client.llen(node_queue(NODE_ID))
    finally:
        client.close()
    return queued == 0 and not worker_state.active_requests and not worker_state.reserved_requests


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
