"""A node's Celery jobs survive the broker: a private Redis (append-only file, fsync always) restarted while a job is
queued, and restarted while a job is in flight on a worker that is SIGKILLed mid-job. The node app acknowledges late
(task_acks_late + reject_on_worker_lost), so the message stays in Redis's unacked set across the restart and is
delivered again once its visibility timeout passes (which needs node_tasks.REDIS_REDELIVERY: without it the agent's
event-loop-less worker never restores it); the handlers are idempotent, so running it again is safe.

The node side only (gpu_node.node_tasks + CacheRegistry): the control plane is not needed to show it."""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from gpu_node.node_tasks import build_node_app
from gpu_node.registry import CacheRegistry
from kcaas.node_messages import PROVISION_TASK, node_queue
from tests.gpu_node.kv_fixtures import tiny_spec
from tests.waiting import eventually

NODE_ID = "node-broker-restart"
VISIBILITY = {"visibility_timeout": 2}  # seconds, not node_tasks' 15 minutes: the rest is the node app's own
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class PrivateRedis:
    """A redis-server of this test's own (port, data dir), restartable with its data."""

    def __init__(self, directory: Path):
        self.directory = directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        assert eventually(lambda: _answers(client), timeout=10), "redis did not start"
        client.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)  # a clean shutdown: the AOF is fsynced
            self.process.wait(timeout=10)
            self.process = None


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def provision_args(cache_id: str) -> list:
    spec = tiny_spec()
    return [cache_id, spec.to_dict(), {"device": 8 * spec.block_bytes}, base64.b64encode(b"k" * 32).decode(), 1]


def send_provision(broker_url: str, cache_id: str) -> None:
    sender = Celery("test-control", broker=broker_url, fixups=[])
    sender.conf.broker_transport_options = VISIBILITY  # the score the unacked index keeps is the delivery time
    sender.send_task(PROVISION_TASK, args=provision_args(cache_id), queue=node_queue(NODE_ID))
    sender.close()


def run_worker(broker_url: str, registry: CacheRegistry):
    """A node app worker in a thread (solo pool, no event loop, as the agent runs it); returns (app, worker, thread)."""
    import threading

    app = build_node_app(broker_url=broker_url, node_id=NODE_ID, endpoint="127.0.0.1:1", registry=registry,
                         transport_options=VISIBILITY)  # fmt: skip
    worker = app.WorkController(app=app, queues=[node_queue(NODE_ID)], pool_cls="solo", concurrency=1,
                                without_heartbeat=True, without_mingle=True, without_gossip=True,
                                use_eventloop=False, hostname=f"{NODE_ID}@test")  # fmt: skip

    def run():
        app.set_current()
        worker.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return app, worker, thread


def stop_worker(worker, thread) -> None:
    from celery.worker import state as worker_state

    worker_state.should_stop = 0
    thread.join(10)
    worker_state.should_stop = None


def test_a_queued_job_survives_a_redis_restart(private_redis):
    send_provision(private_redis.url, "c-queued")
    private_redis.restart()
    registry = CacheRegistry(device_capacity_bytes=1 << 20, device="cpu")
    _, worker, thread = run_worker(private_redis.url, registry)
    try:
        assert eventually(lambda: registry.get("c-queued") is not None, timeout=20)
    finally:
        stop_worker(worker, thread)


def _slow_worker_process(broker_url: str, started_path: str) -> None:
    """A node worker whose provisioning takes long enough to be killed in the middle (the registry's work is
    stretched; Celery, Redis and the task are the real ones)."""

    class SlowRegistry(CacheRegistry):
        def provision(self, **kwargs):
            Path(started_path).write_text("started")
            time.sleep(60)
            return super().provision(**kwargs)

    registry = SlowRegistry(device_capacity_bytes=1 << 20, device="cpu")
    app = build_node_app(broker_url=broker_url, node_id=NODE_ID, endpoint="127.0.0.1:1", registry=registry,
                         transport_options=VISIBILITY)  # fmt: skip
    app.WorkController(app=app, queues=[node_queue(NODE_ID)], pool_cls="solo", concurrency=1,
                       without_heartbeat=True, without_mingle=True, without_gossip=True, use_eventloop=False,
                       hostname=f"{NODE_ID}-slow@test").start()  # fmt: skip


def test_a_job_in_flight_when_its_worker_dies_and_redis_restarts_runs_again(private_redis, tmp_path):
    started = tmp_path / "started"
    process = mp.get_context("spawn").Process(target=_slow_worker_process, args=(private_redis.url, str(started)))
    process.start()
    try:
        send_provision(private_redis.url, "c-in-flight")
        client = redis.Redis.from_url(private_redis.url)
        assert eventually(lambda: started.exists(), timeout=30), "the worker never started the job"
        # not acknowledged (acks_late): still in the broker, in the unacked set (or, once its 2 s visibility
        # timeout passed and an idle poll restored it, back on its queue)
        assert client.hlen("unacked") + client.llen(node_queue(NODE_ID)) == 1
        os.kill(process.pid, signal.SIGKILL)  # the worker dies mid-job
        process.join(10)
        client.close()
    finally:
        if process.is_alive():
            process.kill()
    private_redis.restart()  # and the broker restarts while the job is unacknowledged

    registry = CacheRegistry(device_capacity_bytes=1 << 20, device="cpu")
    _, worker, thread = run_worker(private_redis.url, registry)
    try:
        assert eventually(lambda: registry.get("c-in-flight") is not None, timeout=30)  # delivered again, ran
        client = redis.Redis.from_url(private_redis.url)
        assert eventually(lambda: client.hlen("unacked") == 0, timeout=10)  # and acknowledged this time
        client.close()
    finally:
        stop_worker(worker, thread)
