"""`make cluster` as the e2e tests run it: scripts/cluster.py (up.py with two node agents) on PostgreSQL and Redis.

- `own_services(database, redis_dbs)`: the services of a test's own: its database on DATABASE_URL's server (the
  tests' PostgreSQL; cluster.py creates it, it is dropped before and after) and Redis dbs of its own on REDIS_URL's
  server (rate limits / key usage, and the Celery broker; flushed before and after);
- `running_cluster`: the cluster in its own session, on free ports, with a private var/ dir and short heartbeat,
  lease and sweep periods;
- `staff_call`: the admin API with the printed staff login.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import psycopg
import redis
from psycopg import sql

from kcaas.spec import KVCacheSpec
from tests.e2e.up_support import assert_session_gone, keep_draining, kill_session, read_banner, start_script

SPEC = KVCacheSpec(
    model_fingerprint="tiny@1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    block_size=16,
    kv_dtype="float16",
    storage_dtype="float16",
)
NODE_BYTES = 256 * SPEC.block_bytes
LEASE_SECONDS = 6  # with 1 s heartbeats: a loaded 2-core machine never misses six in a row


def free_ports(count: int) -> int:
    """A base port with `count` consecutive ports free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no consecutive free ports")


def server_url(database: str) -> str:
    """DATABASE_URL's server (the tests' PostgreSQL), pointed at `database`."""
    parts = urlsplit(os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/kcaas")
    return parts._replace(path=f"/{database}").geturl()


def admin_url(database: str) -> str:
    """The same server's `postgres` database, to create and drop `database` from."""
    return urlsplit(server_url(database))._replace(path="/postgres").geturl()


def drop_database(database: str) -> None:
    with psycopg.connect(admin_url(database), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))


@contextlib.contextmanager
def own_services(database: str, redis_dbs: tuple[int, int]) -> Iterator[dict]:
    """Yields the cluster's service variables: `database` fresh (cluster.py creates it), redis_dbs (rate limits / key
    usage, the Celery broker) empty; both cleaned up afterwards."""
    redis_base = urlsplit(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")._replace(path="").geturl()
    clients = [redis.Redis.from_url(f"{redis_base}/{db}") for db in redis_dbs]
    drop_database(database)
    for client in clients:
        client.flushdb()
    yield {
        "DATABASE_URL": server_url(database),
        "REDIS_URL": f"{redis_base}/{redis_dbs[0]}",
        "CELERY_BROKER_URL": f"{redis_base}/{redis_dbs[1]}",
    }
    for client in clients:
        client.flushdb()
        client.close()
    drop_database(database)


def staff_call(url: str, password: str, method: str = "GET") -> dict:
    auth = base64.b64encode(f"admin:{password}".encode()).decode()
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Basic {auth}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def running_cluster(tmp_path, services: dict, *args: str):
    """scripts/cluster.py in its own session on free ports: yields (process, banner, output so far, ports);
    SIGKILLs the whole session on the way out if it is still running."""
    port, node_port, metrics_port = free_ports(1), free_ports(2), free_ports(2)
    env = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE", "KCAAS_NODE_ENDPOINT"}}
    env.update(services)
    env.update(
        KCAAS_VAR_DIR=str(tmp_path / "var"),
        KCAAS_PORT=str(port),
        KCAAS_NODE_PORT=str(node_port),
        KCAAS_NODE_METRICS_PORT=str(metrics_port),
        KCAAS_NODE_DEVICE_BYTES=str(NODE_BYTES),
        KCAAS_NODE_HEARTBEAT_SECONDS="1",
        KCAAS_NODE_LEASE_SECONDS=str(LEASE_SECONDS),
        KCAAS_LEASE_SWEEP_SECONDS="1",
        LOG_LEVEL="WARNING",
    )
    stderr = open(tmp_path / "cluster.stderr", "w+")  # a file: a chatty child never blocks on a full pipe
    cluster = start_script("cluster.py", env, stderr, *args)
    try:
        banner = read_banner(cluster, "make cluster", tmp_path / "cluster.stderr")
        output = [banner]  # "".join(output): everything printed so far
        keep_draining(cluster, output)
        cluster.stderr_file = stderr
        yield cluster, banner, output, (port, node_port, metrics_port)
    finally:
        kill_session(cluster)
        stderr.close()
    assert_session_gone(cluster)  # no child of make cluster outlives it
