"""kcaas.Client against the real control plane: pytest-django's live_server (the project's WSGI app on a real socket,
real PostgreSQL, real Redis rate limiter) and, for provisioning, two real Celery workers in threads on the real
broker: the control plane's on `control` and the minimal node agent of tests/caches/node_consumer.py on the node's
queue (as tests/caches/test_provisioning_integration.py runs them)."""

import uuid

import pytest

import kcaas
from tests.caches import node_consumer
from tests.caches.conftest import make_node, make_tenant  # noqa: F401 - fixtures reused
from tests.waiting import eventually

# The workers outlive each test, so the node they serve keeps one id (its own, distinct from the caches tests').
NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-0000005d4c11")


@pytest.fixture(scope="module")
def workers():
    yield from node_consumer.module_workers(NODE_ID)


@pytest.fixture
def node(make_node, workers):
    """A registered node (8 GiB device) with the id the node worker serves; the consumer told to succeed."""
    yield node_consumer.adopt_node(make_node(), NODE_ID)
    assert eventually(lambda: node_consumer.workers_settled(NODE_ID), timeout=20), "the workers did not settle"


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
