"""`make cluster`: the docker-compose topology as local processes on loopback. PostgreSQL (DATABASE_URL) and Redis
(REDIS_URL) must answer (the Makefile starts them through scripts/services.sh); the database is created when it does
not exist. Then scripts/up.py with `--agents 2 --require-services` (KCAAS_AGENTS changes the count): gunicorn, the
control queue's Celery worker, Celery beat and two node agents, each with its own node credential, TLS 1.3
data-plane port, metrics port, mutual-TLS migration listener (so a drain moves caches to the other agent) and SSD
root (var/cluster/kcaas-ssd, var/cluster/kcaas-ssd-2, ...). Its state lives under var/cluster/ (KCAAS_VAR_DIR).
Extra arguments go to up.py (`--survive-agent-loss`: an agent that dies is reported and its node marked lost, the
rest keep running).
"""

from __future__ import annotations

import os
import sys
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
    return up.main(["--agents", os.environ.get("KCAAS_AGENTS") or "2", "--require-services", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
