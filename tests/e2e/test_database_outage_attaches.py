"""PostgreSQL stopped and started while tenants attach and detach through the REST API: no call fails (the SDK
retries the 503s, attaches under one Idempotency-Key), every cache reaches a final state (ready, then detached),
nothing is lost (no cache stays provisioning or detaching, every reservation comes back) and nothing is doubled
(one cache per attach call, whatever the retries).

All of it real and of this test's own: a PostgreSQL cluster and a Redis broker (tests.faults), gunicorn, the control
queue's Celery worker and Celery beat as processes (as `make up` runs them, with short outbox periods), and a node:
the agent's real Celery side (gpu_node.agent.tasks + CacheRegistry) in a worker thread, registered over HTTP with its
credential."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest

import kcaas
from gpu_node.agent.process import ControlPlane
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from kcaas.node_protocol.messages import node_queue
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import running_workers
from tests.faults import PrivatePostgres, PrivateRedis, free_port, start_calls, stop_process
from tests.fleet.node_keys import TEST_SEALING_KEY, TEST_SEALING_PUBLIC_KEY
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
SPEC = KVCacheSpec(
    model_fingerprint="tiny@1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    block_size=16,
    kv_dtype="float16",
    storage_dtype="float16",
)
CAPACITY = {"device": 4 * SPEC.block_bytes}
BEFORE, DURING = 3, 6  # caches attached before the outage (detached during it), and attached during it
OUTAGE_SECONDS = 5
pytestmark = pytest.mark.skipif(
    PrivatePostgres.available() is not None or PrivateRedis.available() is not None,
    reason="needs PostgreSQL server binaries and redis-server",
)


def _manage(env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _spawn(stack: ExitStack, env: dict, log: Path, *command: str) -> subprocess.Popen:
    sink = stack.enter_context(open(log, "wb"))
    process = subprocess.Popen(
        [sys.executable, "-m", *command], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT
    )
    stack.callback(stop_process, process, timeout=20)
    return process


def _platform_env(database: PrivatePostgres, broker: PrivateRedis, var: Path) -> dict:
    return {
        **os.environ,
        "DATABASE_URL": database.create_database("kcaas"),
        "CELERY_BROKER_URL": broker.url,
        "KCAAS_VAR_DIR": str(var),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
        "KCAAS_QUOTA_MAX_RPS": "100000",
        "KCAAS_NODE_LEASE_SECONDS": "900",
        "KCAAS_ORDER_DISPATCH_SECONDS": "0.5",
        "KCAAS_ORDER_RESEND_SECONDS": "2",
        "KCAAS_ORDER_RESEND_MAX_SECONDS": "4",
    }


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _rows(database_url: str, sql: str, params: tuple = ()):
    with psycopg.connect(database_url, connect_timeout=5) as conn:
        return conn.execute(sql, params).fetchall()


def test_attaches_and_detaches_through_a_postgresql_restart_all_finish_once(tmp_path, monkeypatch):
    monkeypatch.delenv("CELERY_BROKER_URL")  # Celery prefers it to the broker the node app is given
    var = tmp_path / "var"
    (tmp_path / "redis").mkdir()
    with ExitStack() as stack:
        database = stack.enter_context(PrivatePostgres())
        broker = stack.enter_context(PrivateRedis(tmp_path / "redis"))
        env = _platform_env(database, broker, var)
        _manage(env, "migrate", "--noinput")
        api_key = _manage(env, "kcaas_create_tenant", "outage").split()[0]
        credential = _manage(env, "kcaas_local_node", "outage-node", "--credential-file", str(var / "node-cred"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        _spawn(
            stack,
            env,
            tmp_path / "web.log",
            "gunicorn",
            "controlplane.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--worker-class",
            "gthread",
            "--threads",
            "8",
            "--access-logfile",
            str(tmp_path / "access.log"),
            "--access-logformat",
            "%(m)s %(U)s %(s)s",
        )
        _spawn(
            stack,
            env,
            tmp_path / "worker.log",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "-Q",
            "control",
            "--pool",
            "solo",
            "--hostname",
            "control@%h",
        )
        _spawn(
            stack,
            env,
            tmp_path / "beat.log",
            "celery",
            "-A",
            "controlplane",
            "beat",
            "--schedule",
            str(tmp_path / "beat-schedule"),
        )
        assert eventually(lambda: _healthy(url), timeout=60), (tmp_path / "web.log").read_text()[-3000:]

        node_id = ControlPlane(url, credential).register(
            endpoint="127.0.0.1:7801",
            capacity={"device": 64 * SPEC.block_bytes, "dram": 0, "ssd": 0},
            sealing_public_key=TEST_SEALING_PUBLIC_KEY,
        )["node"]["id"]
        registry = CacheRegistry(device_capacity_bytes=64 * SPEC.block_bytes, device="cpu")
        node_app = build_node_app(
            broker_url=broker.url,
            node_id=node_id,
            endpoint="127.0.0.1:7801",
            registry=registry,
            sealing_key=TEST_SEALING_KEY,
        )
        stack.enter_context(running_workers((node_app, [node_queue(node_id)])))

        client = kcaas.Client(url, api_key, timeout=15)
        early = [client.attach(f"early-{i}", SPEC, CAPACITY, timeout=60) for i in range(BEFORE)]
        database.stop()
        threads, results = start_calls(
            [(lambda i=i: client.attach(f"during-{i}", SPEC, CAPACITY, wait=False)) for i in range(DURING)]
            + [(lambda c=c: client.detach(c.id)) for c in early]
        )
        time.sleep(OUTAGE_SECONDS)  # the outage itself: its length is what is under test
        database.start()
        for thread in threads:
            thread.join(60)
        assert not [r for r in results if isinstance(r, Exception) or r is None], results

        attached = [r.id for r in results[:DURING]]
        db_url = env["DATABASE_URL"]

        def in_state(ids, state):
            rows = _rows(
                db_url, "SELECT state FROM caches_cache WHERE id = ANY(%s)", ([uuid.UUID(str(i)) for i in ids],)
            )
            return {s for (s,) in rows} == {state}

        assert eventually(lambda: in_state(attached, "ready"), timeout=90), _rows(
            db_url, "SELECT name, state, failure_reason FROM caches_cache"
        )
        assert eventually(lambda: in_state([c.id for c in early], "detached"), timeout=90)
        for cache_id in attached:
            client.detach(cache_id)
        assert eventually(lambda: in_state(attached, "detached"), timeout=90)
        names = _rows(db_url, "SELECT name, count(*) FROM caches_cache GROUP BY name")
        assert sorted(names) == sorted(
            [(f"early-{i}", 1) for i in range(BEFORE)] + [(f"during-{i}", 1) for i in range(DURING)]
        )  # none doubled
        assert _rows(
            db_url,
            "SELECT device_reserved_bytes, dram_reserved_bytes, ssd_reserved_bytes FROM fleet_node WHERE id = %s",
            (uuid.UUID(node_id),),
        ) == [(0, 0, 0)]
        assert registry.cache_ids() == []  # the node holds nothing either
        web_log = (tmp_path / "web.log").read_text(errors="replace")
        assert "Traceback" not in web_log, web_log[-3000:]
        statuses = [line.split()[-1] for line in (tmp_path / "access.log").read_text().splitlines() if line.strip()]
        assert "503" in statuses, "no request met the outage: the test proved nothing"
        assert not [s for s in statuses if s.startswith("5") and s != "503"], statuses
