"""Privacy fixtures: the caches room's tenants, nodes and staff client (real services, real authentication), and
checks over the audit trail's rows with audit.chain's own functions."""

import contextlib
import json

import pytest

from audit import chain
from audit.models import AuditEvent
from tests.caches.conftest import _close_thread_connections, stop_workers_together
from tests.caches.conftest import (  # noqa: F401 - fixtures re-exported for this room's tests
    fast_password_hasher,
    make_node,
    make_tenant,
    staff_client,
    tenant_a,
    tenant_b,
)


@pytest.fixture
def no_grace(settings):
    """Erasures start at the first beat after the request."""
    settings.KCAAS_ERASURE_GRACE_SECONDS = 0


def audit_chain_problems() -> list[str]:
    """Every break of the trail: a commitment (while the salt is kept), a hash, or a link that does not match."""
    problems, prev = [], chain.GENESIS_HASH
    for event in AuditEvent.objects.order_by("seq"):
        fields = event.chain_fields()
        if event.salt is not None and chain.commitments_of(bytes(event.salt), fields) != event.commitments:
            problems.append(f"event {event.seq}: commitments")
        if event.prev_hash != prev or chain.event_hash(prev, fields, event.commitments) != event.hash:
            problems.append(f"event {event.seq}: hash or link")
        prev = event.hash
    return problems


def audit_rows_mentioning(*needles: str) -> list[int]:
    """Seqs of audit events whose any stored field contains one of `needles` (case-insensitive)."""
    found = []
    for event in AuditEvent.objects.order_by("seq"):
        text = json.dumps({**event.chain_fields(), "commitments": event.commitments}, default=str).lower()
        if any(needle.lower() in text for needle in needles):
            found.append(event.seq)
    return found


@contextlib.contextmanager
def running_workers(*apps_and_queues):
    """tests.caches.conftest.running_workers for SEVERAL node apps in one process: each worker thread makes its own
    app the thread's current app, so a task resolves in the app of the worker that received it (Celery's
    trace_task_ret looks tasks up in current_app, which in a thread without one is the last default app: with two
    node apps both workers would run node two's tasks)."""
    from celery.contrib.testing.worker import TestWorkController, start_worker
    from celery.signals import task_postrun

    from controlplane.celery import app as control_app

    class OwnAppWorkController(TestWorkController):
        def start(self):
            self.app.set_current()  # runs in the worker's own thread
            return super().start()

    options = {"perform_ping_check": False, "shutdown_timeout": 20, "use_eventloop": False,
               "WorkController": OwnAppWorkController}  # fmt: skip
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
