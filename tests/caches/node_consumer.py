"""A minimal node agent for the integration tests: a Celery app of its own (no Django, like the real agent) whose
workers consume a node's queue and answer the control plane by task name on the `control` queue.

`NodeBehaviour` tells it which node it is and whether to fail; it records what it received so the test can check
the messages (spec, capacity, hash key, epoch).
"""

import base64
import os
import threading
from dataclasses import dataclass, field

from celery import Celery

from kcaas.spec import KVCacheSpec

CONTROL_QUEUE = "control"

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
    lock: threading.Lock = field(default_factory=threading.Lock)


behaviour = NodeBehaviour()


def _answer(task_name: str, args: list) -> None:
    node_app.send_task(task_name, args=args, queue=CONTROL_QUEUE)


@node_app.task(name="kcaas.node.provision_cache", shared=False)
def provision_cache(cache_id: str, spec: dict, capacity: dict, hash_key_b64: str, epoch: int, tenant_id: str = "") -> None:
    with behaviour.lock:
        behaviour.received.append(("provision_cache", [cache_id, spec, capacity, hash_key_b64, epoch, tenant_id]))
        fail_reason = behaviour.fail_reason
    # What a real agent checks before allocating: a valid layout and a 32-byte key.
    layout = KVCacheSpec.from_dict(spec)
    ok = fail_reason is None and len(base64.b64decode(hash_key_b64)) == 32 and capacity["device"] >= layout.block_bytes
    reason = "" if ok else (fail_reason or "bad provisioning request")
    _answer("caches.provision_result", [cache_id, behaviour.node_id, ok, reason, behaviour.endpoint if ok else ""])


@node_app.task(name="kcaas.node.detach_cache", shared=False)
def detach_cache(cache_id: str, epoch: int) -> None:
    with behaviour.lock:
        behaviour.received.append(("detach_cache", [cache_id, epoch]))
    _answer("caches.detach_result", [cache_id, behaviour.node_id])
