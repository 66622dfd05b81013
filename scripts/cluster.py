"""`make cluster`: the docker-compose topology as local processes on loopback. PostgreSQL (DATABASE_URL) and Redis
(REDIS_URL) must answer (the Makefile starts them through scripts/services.sh); the database is created when it does
not exist. Then scripts/up.py with `--agents 2 --require-services` (KCAAS_AGENTS changes the count): gunicorn, the
control queue's Celery worker, Celery beat and two node agents, each with its own node credential, TLS 1.3
data-plane port, metrics port, mutual-TLS migration listener (so a drain moves caches to the other agent) and SSD
root (var/cluster/kcaas-ssd, var/cluster/kcaas-ssd-2, ...). Its state lives under var/cluster/ (KCAAS_VAR_DIR).
Extra arguments go to up.py (`--survive-agent-loss`: an agent that dies is reported and its node marked lost, the
rest keep running).

Before up.py, the network tier's store (devtools.store_services: a Mooncake master and one store server with a
KCAAS_NETWORK_STORE_SEGMENT_BYTES segment, default 256 MiB, on free loopback ports, logs in var/cluster/network-store)
starts, and its line is printed before up.py's banner; every agent gets KCAAS_NETWORK_STORE_MASTER and
KCAAS_NETWORK_STORE_METADATA, the control plane KCAAS_NETWORK_STORE_BYTES (the segment) unless set. It is stopped
after up.py. When KCAAS_NETWORK_STORE_MASTER is already set (a store of the user's own) or the `network` extra is not
installed, none is started.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

import up


def ensure_database(url: str) -> None:
    """CREATE DATABASE for DATABASE_URL's database when it does not exist (through the server's `postgres` db)."""
    import psycopg
    from psycopg import sql

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin_url = parts._replace(path="/postgres").geturl()
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            print(f"cluster: created database {name}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres") or not os.environ.get("REDIS_URL"):
        raise SystemExit(
            "make cluster: set DATABASE_URL=postgres://... and REDIS_URL=redis://... "
            "(the Makefile takes them from scripts/services.sh)"
        )
    ensure_database(url)
    os.environ.setdefault("KCAAS_VAR_DIR", str(up.REPO / "var" / "cluster"))  # not make up's SQLite-bound var/
    # until up.py installs its own handlers, SIGTERM interrupts like Ctrl-C: the finally below stops the store
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    store = network_store(Path(os.environ["KCAAS_VAR_DIR"]) / "network-store")  # not started yet: stop() is safe
    try:
        if store is not None:
            start_network_store(store)
        return up.main(["--agents", os.environ.get("KCAAS_AGENTS") or "2", "--require-services", *argv])
    finally:
        if store is not None:
            store.stop()


def network_store(workdir: Path):
    """The network tier's store for the agents (a StoreServices, not started), or None when the user's own is
    configured or the `network` extra is not installed (said on stdout)."""
    from devtools.store_services import MASTER_ENV, MIB, StoreServices, mooncake_importable

    if os.environ.get(MASTER_ENV):
        print(f"network store   {os.environ[MASTER_ENV]} (KCAAS_NETWORK_STORE_MASTER: yours)", flush=True)
        return None
    if not mooncake_importable():
        print("network store   none: the `network` extra is not installed (the agents run without it)", flush=True)
        return None
    segment = int(os.environ.get("KCAAS_NETWORK_STORE_SEGMENT_BYTES") or 256 * MIB)
    return StoreServices(workdir, segment_bytes=segment)


def start_network_store(store) -> None:
    """Starts the store and prints its line; its endpoints go into os.environ, which up.py's children inherit."""
    from devtools.store_services import MIB, StoreStartError

    try:
        endpoints = store.start()
    except StoreStartError as error:
        raise SystemExit(f"make cluster: the network store did not start: {error}") from None
    os.environ.update(endpoints.env())
    os.environ.setdefault("KCAAS_NETWORK_STORE_BYTES", str(store.segment_bytes))
    print(
        f"network store   master {endpoints.master}, metadata {endpoints.metadata_url}, metrics "
        f"http://127.0.0.1:{endpoints.metrics_port}/metrics; one store server, {store.segment_bytes // MIB} MiB "
        f"(store pids master={endpoints.master_pid} store-server-0={endpoints.store_server_pids[0]}; "
        f"logs {store.workdir})",
        flush=True,
    )


if __name__ == "__main__":
    try:
        raise SystemExit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before up.py's handlers: everything started is stopped
        raise SystemExit(130) from None
