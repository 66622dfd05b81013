"""A node's Celery jobs survive the broker: a private Redis (append-only file, fsync always) restarted while a job is
queued, and restarted while a job is in flight on a worker that is SIGKILLed mid-job. The node app acknowledges late
(task_acks_late + reject_on_worker_lost), so the message stays in Redis's unacked set across the restart and is
delivered again once its visibility timeout passes (which needs node_tasks.REDIS_REDELIVERY: without it the agent's
event-loop-less worker never restores it); the handlers are idempotent, so running it again is safe.

The node side only (gpu_node.agent.tasks + CacheRegistry): the control plane is not needed to show it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from kcaas.node_protocol.messages import PROVISION_TASK, ProvisionCache, node_queue
from kcaas.node_protocol.sealing import seal
from tests.faults import PrivateRedis
from tests.fleet.node_keys import TEST_SEALING_KEY, TEST_SEALING_PUBLIC_KEY
from tests.gpu_node.kv_fixtures import tiny_spec
from tests.waiting import eventually

NODE_ID = "node-broker-restart"
VISIBILITY = {"visibility_timeout": 2}  # seconds, not node_tasks' 15 minutes: the rest is the node app's own
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture
def private_redis(tmp_path, monkeypatch):
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)  # Celery would prefer it to the private broker's URL
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def provision_order(cache_id: str) -> dict:
    spec = tiny_spec()
    box = seal(
        b"k" * 32,
        public_key_b64=TEST_SEALING_PUBLIC_KEY,
        task=PROVISION_TASK,
        node_id=NODE_ID,
        cache_id=cache_id,
        field="hash_key",
    )
    order = ProvisionCache(
        cache_id=cache_id,
        spec=spec.to_dict(),
        capacity={"device": 8 * spec.block_bytes},
        hash_key_box=box,
        epoch=1,
        tenant_id="tenant-1",
        ssd_key_box="",
        network_write_through=False,
    )
    return order.to_dict()


def send_provision(broker_url: str, cache_id: str) -> None:
    sender = Celery("test-control", broker=broker_url, fixups=[])
    sender.conf.broker_transport_options = VISIBILITY  # the score the unacked index keeps is the delivery time
    sender.send_task(PROVISION_TASK, kwargs=provision_order(cache_id), queue=node_queue(NODE_ID))
    sender.close()


def _worker_process(broker_url: str, marker_dir: str, stall_seconds: float) -> None:
    """A node worker in a process of its own (solo pool, no event loop, as the agent runs it). Its registry marks
    each provisioning it starts and finishes in `marker_dir`; `stall_seconds` stretches the work so a test can kill
    the worker in the middle (Celery, Redis and the task are the real ones)."""

    class MarkingRegistry(CacheRegistry):
        def provision(self, **kwargs):
            Path(marker_dir, f"started-{kwargs['cache_id']}").write_text("")
            time.sleep(stall_seconds)
            hosted = super().provision(**kwargs)
            Path(marker_dir, f"provisioned-{kwargs['cache_id']}").write_text("")
            return hosted

    os.environ.pop("CELERY_BROKER_URL", None)  # Celery prefers that variable to the broker it is given
    registry = MarkingRegistry(device_capacity_bytes=1 << 20, device="cpu")
    app = build_node_app(
        broker_url=broker_url,
        node_id=NODE_ID,
        endpoint="127.0.0.1:1",
        registry=registry,
        transport_options=VISIBILITY,
        sealing_key=TEST_SEALING_KEY,
    )
    app.WorkController(
        app=app,
        queues=[node_queue(NODE_ID)],
        pool_cls="solo",
        concurrency=1,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        use_eventloop=False,
        hostname=f"{NODE_ID}-{os.getpid()}@test",
    ).start()


@contextlib.contextmanager
def worker_process(broker_url: str, marker_dir: Path, stall_seconds: float = 0.0):
    process = mp.get_context("spawn").Process(target=_worker_process, args=(broker_url, str(marker_dir), stall_seconds))
    process.start()
    try:
        yield process
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)


def test_a_queued_job_survives_a_redis_restart(private_redis, tmp_path):
    send_provision(private_redis.url, "c-queued")
    private_redis.restart()
    with worker_process(private_redis.url, tmp_path):
        assert eventually(lambda: (tmp_path / "provisioned-c-queued").exists(), timeout=60)


def test_a_job_in_flight_when_its_worker_dies_and_redis_restarts_runs_again(private_redis, tmp_path):
    with worker_process(private_redis.url, tmp_path, stall_seconds=120) as slow:
        send_provision(private_redis.url, "c-in-flight")
        client = redis.Redis.from_url(private_redis.url)
        assert eventually(lambda: (tmp_path / "started-c-in-flight").exists(), timeout=60), "the job never started"
        # not acknowledged (acks_late): still in the broker, in the unacked set (or, once its 2 s visibility
        # timeout passed and an idle poll restored it, back on its queue)
        assert client.hlen("unacked") + client.llen(node_queue(NODE_ID)) == 1
        os.kill(slow.pid, signal.SIGKILL)  # the worker dies mid-job
        slow.join(10)
        client.close()
    private_redis.restart()  # and the broker restarts while the job is unacknowledged

    with worker_process(private_redis.url, tmp_path):
        assert eventually(lambda: (tmp_path / "provisioned-c-in-flight").exists(), timeout=60)  # delivered again
        client = redis.Redis.from_url(private_redis.url)
        assert eventually(lambda: client.hlen("unacked") == 0, timeout=20)  # and acknowledged this time
        client.close()
