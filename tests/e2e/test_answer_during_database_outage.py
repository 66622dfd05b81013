"""A node's answer that meets a PostgreSQL outage is not lost. The deterministic schedule: no control worker runs,
a cache is attached (provisioning), its node's answer (`caches.provision_result`) waits on the control queue,
PostgreSQL is stopped, the control worker starts and takes the answer (the database is down: the task fails with
OperationalError), PostgreSQL starts again: the answer is retried and the cache becomes ready, its reservation kept.

Everything is of this test's own and real: a PostgreSQL cluster (tests.faults.PrivatePostgres) migrated by
manage.py, a private Redis broker, and the control queue's Celery worker as `make up` runs it (a process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from celery import Celery

from kcaas.node_protocol.messages import CONTROL_QUEUE, PROVISION_RESULT_TASK, ProvisionResult
from tests.faults import PrivatePostgres, PrivateRedis, stop_process
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    PrivatePostgres.available() is not None or PrivateRedis.available() is not None,
    reason="needs PostgreSQL server binaries and redis-server",
)
ATTACH = """
import django
django.setup()
from caches import services
from fleet import services as fleet
from kcaas.spec import KVCacheSpec
from tenants import services as tenants

tenant = tenants.tenant_create(name="outage")
node = fleet.node_create(name="n1").node
fleet.node_register(node_id=node.pk, endpoint="10.9.0.1:7000", capacity={"device": 1 << 30, "dram": 0, "ssd": 0})
spec = KVCacheSpec(model_fingerprint="tiny@1", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16,
                   kv_dtype="float16", storage_dtype="float16")
cache = services.cache_attach(tenant_id=tenant.pk, name="c", spec=spec, capacity={"device": 64 * spec.block_bytes})
print(cache.pk, node.pk)
"""


def cache_state(database_url: str, cache_id: str) -> tuple[str, int] | None:
    """(cache state, node's reserved device bytes), or None while the database does not answer."""
    try:
        with psycopg.connect(database_url, connect_timeout=2) as conn:
            return conn.execute(
                "SELECT c.state, n.device_reserved_bytes FROM caches_cache c JOIN fleet_node n ON n.id = c.node_id "
                "WHERE c.id = %s",
                (cache_id,),
            ).fetchone()
    except psycopg.OperationalError:
        return None


def test_a_provisioning_answer_handled_while_postgresql_is_down_is_retried_until_it_lands(tmp_path, monkeypatch):
    monkeypatch.delenv("CELERY_BROKER_URL")  # Celery prefers it to the broker a new app is given
    (tmp_path / "redis").mkdir()
    with PrivatePostgres() as database, PrivateRedis(tmp_path / "redis") as broker:
        env = {
            **os.environ,
            "DATABASE_URL": database.create_database("kcaas"),
            "CELERY_BROKER_URL": broker.url,
            "KCAAS_VAR_DIR": str(tmp_path / "var"),
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
        }
        for step in (["manage.py", "migrate", "--noinput"], ["-c", ATTACH]):
            done = subprocess.run(
                [sys.executable, *step], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
            )
            assert done.returncode == 0, done.stderr[-3000:]
        cache_id, node_id = done.stdout.split()
        assert cache_state(env["DATABASE_URL"], cache_id)[0] == "provisioning"

        node_app = Celery("outage-node", broker=broker.url, fixups=[])  # the node answers, as an agent does
        answer = ProvisionResult(cache_id=cache_id, node_id=node_id, ok=True, reason="", endpoint="10.9.0.1:7000")
        node_app.send_task(PROVISION_RESULT_TASK, kwargs=answer.to_dict(), queue=CONTROL_QUEUE)
        database.stop()
        log = tmp_path / "worker.log"
        with open(log, "wb") as sink:
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "controlplane",
                    "worker",
                    "-Q",
                    "control",
                    "--pool",
                    "solo",
                    "--loglevel",
                    "info",
                    "--hostname",
                    "outage@%h",
                ],
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            assert eventually(lambda: "Retry in" in log.read_text(errors="replace"), timeout=60), log.read_text(
                errors="replace"
            )[-3000:]  # the answer met the outage
            database.start()
            assert eventually(
                lambda: cache_state(env["DATABASE_URL"], cache_id) == ("ready", 64 * 2048), timeout=120
            ), (cache_state(env["DATABASE_URL"], cache_id), log.read_text(errors="replace")[-3000:])
        finally:
            stop_process(worker, timeout=20)
