"""Caches fixtures: tenants and keys made through the tenants services, nodes registered through the fleet services,
API clients holding a real key (real authentication, real Redis rate limiter), and attach bodies."""

import base64
import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass

import pytest
from celery import bootsteps
from celery.worker import state as worker_state
from django.contrib.auth import get_user_model
from django.db import connections
from rest_framework.test import APIClient

from caches.models import Cache
from fleet import services as fleet_services
from fleet.models import Node
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.fleet.node_keys import TEST_SEALING_PUBLIC_KEY

GIB = 2**30
PASSWORD = "correct horse battery staple"
_ports = itertools.count(9101)
_names = itertools.count(1)

# A tiny layout: 2 layers x 2 KV heads x 8 dims x fp16 x 16 tokens = 2*2*2*8*2*16 = 2048 bytes per block.
SPEC = {
    "model_fingerprint": "tiny-llama@rev1",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "block_size": 16,
    "kv_dtype": "float16",
    "storage_dtype": "float16",
    "attention": "mha",
    "kv_lora_rank": 0,
    "qk_rope_head_dim": 0,
}
BLOCK_BYTES = 2048


def attach_body(name: str = "c1", *, device: int = 64 * BLOCK_BYTES, dram: int = 0, ssd: int = 0, **spec) -> dict:
    return {"name": name, "spec": {**SPEC, **spec}, "capacity": {"device": device, "dram": dram, "ssd": ssd}}


def bearer_client(raw_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return client


@dataclass
class TenantHandle:
    tenant: Tenant
    raw_key: str

    @property
    def client(self) -> APIClient:
        return bearer_client(self.raw_key)

    def key(self, *scopes: str) -> APIClient:
        """A client with another key of this tenant, holding `scopes`."""
        issued = tenant_services.api_key_issue(tenant=self.tenant, scopes=list(scopes))
        return bearer_client(issued.raw_key)


@pytest.fixture
def make_tenant(db):
    """make_tenant(scopes=("caches:write",), **quota) -> TenantHandle with a fresh key. Rate limits are lifted so
    tests are not throttled (the limiter has its own tests)."""

    def make(*, scopes=("caches:write",), **quota) -> TenantHandle:
        tenant = tenant_services.tenant_create(name=f"tenant-{next(_names)}-{uuid.uuid4().hex[:6]}")
        tenant_services.quota_update(tenant=tenant, max_requests_per_second=100_000, **quota)
        issued = tenant_services.api_key_issue(tenant=tenant, scopes=list(scopes))
        return TenantHandle(tenant=tenant, raw_key=issued.raw_key)

    return make


@pytest.fixture
def tenant_a(make_tenant) -> TenantHandle:
    return make_tenant()


@pytest.fixture
def tenant_b(make_tenant) -> TenantHandle:
    return make_tenant()


@pytest.fixture
def make_node(db):
    """make_node(device=, dram=, ssd=) -> a registered (ready, live lease) Node holding the test sealing key
    (tests/fleet/node_keys.py; sealing_public_key=None: an agent older than key sealing)."""

    def make(
        *,
        device: int = 8 * GIB,
        dram: int = 64 * GIB,
        ssd: int = 512 * GIB,
        now=None,
        sealing_public_key: str | None = TEST_SEALING_PUBLIC_KEY,
    ) -> Node:
        issued = fleet_services.node_create(name=f"node-{next(_names)}-{uuid.uuid4().hex[:6]}")
        fleet_services.node_register(
            node_id=issued.node.pk,
            endpoint=f"10.1.0.1:{next(_ports)}",
            capacity={"device": device, "dram": dram, "ssd": ssd},
            now=now,
            sealing_public_key=sealing_public_key,
        )
        return Node.objects.get(pk=issued.node.pk)

    return make


@pytest.fixture
def node(make_node) -> Node:
    return make_node()


@pytest.fixture
def fast_password_hasher(settings):
    """Basic authentication hashes the password on every request: a fast hasher keeps staff tests quick."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff_client(db, fast_password_hasher) -> APIClient:
    get_user_model().objects.create_user(f"ops-{uuid.uuid4().hex[:6]}", password=PASSWORD, is_staff=True)
    user = get_user_model().objects.filter(is_staff=True).latest("id")
    client = APIClient()
    token = base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()
    client.credentials(HTTP_AUTHORIZATION=f"Basic {token}")
    return client


@pytest.fixture
def placed(tenant_a, make_node):
    """(a ready cache of tenant A, the small node best fit put it on, a larger node it can move to); every node's
    queue is purged afterwards (the migration tests leave orders on them)."""
    small, large = make_node(device=40 * BLOCK_BYTES), make_node(device=80 * BLOCK_BYTES)
    response = tenant_a.client.post("/api/v1/caches", attach_body("placed", device=8 * BLOCK_BYTES), format="json")
    cache = make_ready(response.json()["id"])
    assert cache.node_id == small.pk
    yield cache, small, large
    for node in Node.objects.all():
        purge_node_queue(node.pk)


def reserved(node: Node) -> dict[str, int]:
    node.refresh_from_db()
    return {tier: getattr(node, f"{tier}_reserved_bytes") for tier in ("device", "dram", "ssd")}


def make_ready(cache_id) -> Cache:
    """Answer provisioning as the cache's node would (the node side has its own integration test)."""
    from caches import services

    cache = Cache.objects.get(pk=cache_id)
    return services.cache_provision_result(
        cache_id=cache.pk, node_id=cache.node_id, ok=True, endpoint=f"{cache.node.endpoint}"
    )


def purge_node_queue(node_id) -> None:
    """Drop what tests sent to a node's queue on the real broker (its list and its kombu binding)."""
    import os

    import redis

    from kcaas.node_protocol.messages import node_queue

    client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    for key in client.scan_iter(match=f"*{node_queue(node_id)}*"):
        client.delete(key)
    client.close()


def run_in_thread(fn, *args, **kwargs):
    """Call fn in a new thread with its own database connection (closed afterwards); returns a started thread whose
    `.result` (or `.error`) is set when it finishes."""
    import threading

    from django.db import connections

    def target():
        try:
            thread.result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            thread.error = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target, daemon=True)
    thread.result = thread.error = None
    thread.start()
    return thread


def stop_workers_together(*workers, timeout=15.0) -> None:
    """Ask every worker to stop at once instead of one after the other (each takes seconds to notice)."""
    worker_state.should_terminate = 0
    deadline = time.monotonic() + timeout
    while any(w.blueprint.state == bootsteps.RUN for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_for_state(client, cache_id, state, timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/api/v1/caches/{cache_id}").json()
        if body["state"] == state:
            return body
        assert time.monotonic() < deadline, f"cache stuck in {body['state']} (waiting for {state})"
        time.sleep(0.05)


def free_port() -> int:
    """A loopback port free right now (for a server a test starts in another process)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _close_thread_connections(**kwargs) -> None:
    connections.close_all()  # worker threads open their own database connections: none outlives a task


class _ShortDrains:
    """A worker's broker connection whose waits for a message end within `cap` seconds (Celery's blocking loop waits
    2 s per drain, once more after it is told to stop, so each stop cost ~2.5 s of every test with a worker)."""

    def __init__(self, connection, cap: float):
        self._connection, self._cap = connection, cap

    def drain_events(self, timeout=None, **kwargs):
        return self._connection.drain_events(timeout=min(timeout or self._cap, self._cap), **kwargs)

    def __getattr__(self, name):
        return getattr(self._connection, name)


def _synloop_with_short_drains(obj, connection, *args, **kwargs):
    from celery.worker import loops

    return loops.synloop(obj, _ShortDrains(connection, 0.1), *args, **kwargs)


@contextlib.contextmanager
def running_workers(*apps_and_queues):
    """Real Celery workers in threads, one per (app, queues), started together and stopped together.

    use_eventloop=False: each worker drains its own connection (with the event loop, two workers in one process
    share kombu's process-global hub and steal each other's socket events). Each worker thread makes its own app the
    thread's current app: Celery looks a received task up in current_app, which in a thread without one is the last
    default app, so with two node apps both workers would otherwise run the second node's tasks."""
    from celery.contrib.testing.worker import TestWorkController, start_worker
    from celery.signals import task_postrun

    from core.celery import app as control_app

    class OwnAppWorkController(TestWorkController):
        def start(self):
            self.app.set_current()  # runs in the worker's own thread
            self.consumer.loop = _synloop_with_short_drains  # stops within 0.1 s of being told
            return super().start()

    options = {
        "perform_ping_check": False,
        "shutdown_timeout": 20,
        "use_eventloop": False,
        "WorkController": OwnAppWorkController,
    }
    task_postrun.connect(_close_thread_connections, weak=False)
    try:
        with contextlib.ExitStack() as stack:
            workers = [
                stack.enter_context(start_worker(app, queues=queues, **options)) for app, queues in apps_and_queues
            ]
            yield workers
            stop_workers_together(*workers)
    finally:
        task_postrun.disconnect(_close_thread_connections)
        control_app.set_current()
        control_app.set_default()
