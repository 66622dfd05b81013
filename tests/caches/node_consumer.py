"""A minimal node agent for the integration tests: a Celery app of its own (no Django, like the real agent) whose
workers consume a node's queue and answer the control plane by task name on the `control` queue.

`NodeBehaviour` tells it which node it is and whether to fail; it records what it received so the test can check
the messages (spec, capacity, sealed hash key, epoch).
"""

import os
import threading
import time
from dataclasses import dataclass, field

from celery import Celery

from kcaas.node_protocol.messages import (
    CONTROL_QUEUE,
    DetachCache,
    DetachResult,
    NodeMessage,
    ProvisionCache,
    ProvisionResult,
)
from kcaas.spec import KVCacheSpec
from tests.fleet.node_keys import TEST_SEALING_PUBLIC_KEY, opened

node_app = Celery("kcaas-test-node", broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/14"))
node_app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@dataclass
class NodeBehaviour:
    node_id: str = ""
    endpoint: str = ""
    fail_reason: str | None = None  # set: provisioning answers failed with this reason
    received: list = field(default_factory=list)  # (task name, args) in arrival order
    since: float = 0.0  # when the workers started: older unacknowledged messages on the broker are not theirs
    lock: threading.Lock = field(default_factory=threading.Lock)


behaviour = NodeBehaviour()


def _answer(message: NodeMessage) -> None:
    node_app.send_task(message.TASK, kwargs=message.to_dict(), queue=CONTROL_QUEUE)


def _received(order: NodeMessage) -> None:
    """Record an order as (task's short name, its field values in order)."""
    with behaviour.lock:
        behaviour.received.append((order.TASK.rsplit(".", 1)[-1], [getattr(order, n) for n in order.field_names()]))


@node_app.task(name=ProvisionCache.TASK, shared=False)
def provision_cache(*args, **fields) -> None:
    order = ProvisionCache.from_call(args, fields)
    _received(order)
    with behaviour.lock:
        fail_reason = behaviour.fail_reason
    # What a real agent checks before allocating: a valid layout and a 32-byte key sealed to it for this message.
    layout = KVCacheSpec.from_dict(order.spec)
    hash_key = opened(order.hash_key_box, task=order.TASK, node_id=behaviour.node_id, cache_id=order.cache_id)
    ok = fail_reason is None and len(hash_key) == 32 and order.capacity["device"] >= layout.block_bytes
    reason = "" if ok else (fail_reason or "bad provisioning request")
    endpoint = behaviour.endpoint if ok else ""
    _answer(
        ProvisionResult(cache_id=order.cache_id, node_id=behaviour.node_id, ok=ok, reason=reason, endpoint=endpoint)
    )


@node_app.task(name=DetachCache.TASK, shared=False)
def detach_cache(*args, **fields) -> None:
    order = DetachCache.from_call(args, fields)
    _received(order)
    _answer(DetachResult(cache_id=order.cache_id, node_id=behaviour.node_id))


# ---- the fixtures' shared part: module-long workers serving one fixed node id ----------------------------------------
def module_workers(node_id):
    """Generator for a module-scoped fixture: the control worker and this consumer on `node_id`'s queue, alive for
    the whole module (starting a pair costs seconds); yields `behaviour`."""
    from core.celery import app as control_app
    from kcaas.node_protocol.messages import node_queue
    from tests.caches.conftest import purge_node_queue, running_workers

    behaviour.since = time.time()
    try:
        with running_workers((control_app, ["control"]), (node_app, [node_queue(node_id)])):
            yield behaviour
    finally:
        purge_node_queue(node_id)


def adopt_node(node, node_id):
    """Give a freshly registered node the id the consumer serves and the sealing key the consumer holds (the keys in
    its orders are sealed to it), tell the consumer who it is and to succeed, and return the node row. (The database
    is emptied between transactional tests, so the id is free again.)"""
    from fleet.models import Node

    Node.objects.filter(pk=node.pk).update(id=node_id, sealing_public_key=TEST_SEALING_PUBLIC_KEY)
    adopted = Node.objects.get(pk=node_id)
    with behaviour.lock:
        behaviour.node_id, behaviour.endpoint = str(adopted.pk), adopted.endpoint
        behaviour.fail_reason, behaviour.received = None, []
    return adopted


def workers_settled(node_id, *, checks: int = 3, interval: float = 0.1) -> bool:
    """Nothing the test set off is still on its way, seen `checks` times in a row: both queues empty, no message of
    theirs delivered and not yet acknowledged (kombu's `unacked` hash: a retry waiting for its countdown, or a
    message taken off the list whose request the worker has not registered yet) and no task in hand. The workers
    outlive the test: an answer handled after the test's database is flushed fails (or deadlocks the flush), and a
    single look can fall in the gap between a worker taking a message and registering it."""
    for check in range(checks):
        if check:
            time.sleep(interval)
        if not _nothing_in_flight(node_id):
            return False
    return True


def _nothing_in_flight(node_id) -> bool:
    import json

    import redis
    from celery.worker import state as worker_state

    from kcaas.node_protocol.messages import node_queue

    queues = (CONTROL_QUEUE, node_queue(node_id))
    client = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])
    try:
        queued = sum(client.llen(queue) for queue in queues)
        tags = client.zrangebyscore("unacked_index", behaviour.since, "+inf")  # kombu: delivery tag -> taken at
        unacked = [json.loads(value) for value in client.hmget("unacked", tags) if value] if tags else []
    finally:
        client.close()
    in_flight = sum(1 for entry in unacked if len(entry) == 3 and entry[2] in queues)  # [message, exchange, key]
    return queued == 0 and in_flight == 0 and not worker_state.active_requests and not worker_state.reserved_requests
