"""Control-plane latency and throughput against a real server: gunicorn + PostgreSQL + Redis, load from loopback.

    python -m bench.controlplane [--quick]

Sets up (through the services, in a database of its own, `kcaas_bench`) a tenant with a high rate limit, a key, a
registered node and ready caches, starts gunicorn (gthread workers, keep-alive) on a free loopback port, and drives
four operations with keep-alive connections from client threads:
    GET /healthz                      no authentication, no database (the floor)
    GET /api/v1/whoami                authenticated (key lookup, hash check, rate limit, usage counter)
    GET /api/v1/caches                authenticated list (one page of the tenant's caches)
    POST /api/v1/caches/{id}/tokens   data-plane token issue (tenant lock, outstanding count, Ed25519 signature)
Figures (last line, JSON): auth_overhead_ms (whoami p50 - healthz p50), list_p99_ms, token_rps, and more.
The client threads share the 2 cores with the server: read the figures as this machine's, side by side.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_DB = "kcaas_bench"


@dataclass
class Operation:
    name: str
    method: str
    path: str
    headers: dict
    body: bytes | None = None


def services_env() -> dict:
    out = subprocess.run([str(REPO / "scripts" / "services.sh")], capture_output=True, text=True, check=True).stdout
    values = dict(line.split("=", 1) for line in out.split())
    base = values["DATABASE_URL"].rsplit("/", 1)[0]
    return {
        "DATABASE_URL": f"{base}/{BENCH_DB}",
        "REDIS_URL": "redis://127.0.0.1:6379/5",
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/4",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }


def ensure_database(database_url: str) -> None:
    import psycopg

    admin_url = database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as connection:
        exists = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (BENCH_DB,)).fetchone()
        if not exists:
            connection.execute(f'CREATE DATABASE "{BENCH_DB}"')


def set_up_tenant(num_caches: int) -> tuple[str, str]:
    """Migrate, then create a tenant, key, node and ready caches; returns (raw key, a ready cache id)."""
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from caches import services as cache_services
    from fleet import services as fleet_services
    from kcaas.spec import KVCacheSpec
    from tenants import services as tenant_services

    run = uuid.uuid4().hex[:8]
    tenant = tenant_services.tenant_create(name=f"bench-{run}")
    tenant_services.quota_update(
        tenant=tenant, max_requests_per_second=100_000, max_data_tokens_outstanding=1_000_000, max_caches=num_caches
    )
    key = tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read", "caches:write"]).raw_key
    node = fleet_services.node_create(name=f"bench-node-{run}").node
    port = 20000 + int(run[:4], 16) % 20000
    fleet_services.node_register(
        node_id=node.id, endpoint=f"127.0.0.1:{port}", capacity={"device": 2**40, "dram": 2**40, "ssd": 2**40}
    )
    spec = KVCacheSpec("bench-model@1", 32, 8, 128, 16, "float16", "float16")
    cache_ids = []
    for index in range(num_caches):
        cache = cache_services.cache_attach(
            tenant_id=tenant.id, name=f"cache-{index}", spec=spec, capacity={"device": 2**30}
        )
        cache_services.cache_provision_result(cache_id=cache.id, node_id=node.id, ok=True)
        cache_ids.append(str(cache.id))
    return key, cache_ids[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(env: dict, port: int) -> subprocess.Popen:
    server_env = {**os.environ, **env, "PYTHONPATH": f"{REPO / 'platform'}:{REPO}"}
    command = [
        sys.executable, "-m", "gunicorn", "controlplane.wsgi:application", "--bind", f"127.0.0.1:{port}",
        "--workers", "2", "--worker-class", "gthread", "--threads", "4", "--keep-alive", "30",
        "--log-level", "warning", "--chdir", str(REPO),
    ]
    server = subprocess.Popen(command, env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"gunicorn did not come up: {server.stderr.read().decode()[-2000:]}")


def drive(port: int, operation: Operation, num_requests: int, concurrency: int) -> dict:
    """num_requests of one operation from `concurrency` keep-alive connections: latencies and throughput."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    per_thread = num_requests // concurrency

    def worker() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine = []
        for _ in range(per_thread):
            begin = time.perf_counter()
            connection.request(operation.method, operation.path, body=operation.body, headers=operation.headers)
            response = connection.getresponse()
            response.read()
            mine.append(time.perf_counter() - begin)
            if response.status >= 300:
                errors.append(f"{operation.name}: HTTP {response.status}")
        connection.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begin
    if errors:
        raise SystemExit(f"{len(errors)} failed requests, e.g. {errors[0]}")
    latencies.sort()
    return {
        "rps": len(latencies) / wall,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        "requests": len(latencies),
    }


def operations(raw_key: str, cache_id: str) -> list[Operation]:
    auth = {"Authorization": f"Bearer {raw_key}"}
    return [
        Operation("healthz", "GET", "/healthz", {}),
        Operation("whoami", "GET", "/api/v1/whoami", auth),
        Operation("list", "GET", "/api/v1/caches?limit=20", auth),
        Operation(
            "token", "POST", f"/api/v1/caches/{cache_id}/tokens",
            {**auth, "Content-Type": "application/json"}, json.dumps({"access": "read"}).encode(),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (well under a minute)")
    args = parser.parse_args(argv)
    num_requests, concurrency, rounds = (400, 4, 3) if args.quick else (3000, 8, 5)
    env = services_env()
    os.environ.update(env)
    sys.path[:0] = [str(REPO / "platform"), str(REPO)]
    ensure_database(env["DATABASE_URL"])
    raw_key, cache_id = set_up_tenant(num_caches=10)
    port = free_port()
    server = start_server(env, port)
    try:
        ops = operations(raw_key, cache_id)
        for op in ops:  # warm up: connections, workers' imports, query plans
            drive(port, op, concurrency * 10, concurrency)
        runs: dict[str, list[dict]] = {op.name: [] for op in ops}
        for _ in range(rounds):  # interleaved rounds: the machine's noise falls on every operation alike
            for op in ops:
                runs[op.name].append(drive(port, op, num_requests, concurrency))
    finally:
        server.terminate()
        server.wait(timeout=10)
        import redis

        redis.Redis.from_url(env["CELERY_BROKER_URL"]).flushdb()  # provisioning messages nobody consumes here
    figures = {name: {k: statistics.median(r[k] for r in results) for k in results[0]} for name, results in runs.items()}
    print(f"bench.controlplane ({'quick' if args.quick else 'full'}): gunicorn 2 gthread workers x 4 threads, "
          f"{concurrency} keep-alive client connections, median of {rounds} rounds of {num_requests} requests")
    print(f"  {'operation':<10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for name, values in figures.items():
        print(f"  {name:<10}{values['rps']:>10.0f}{values['p50_ms']:>10.2f}{values['p99_ms']:>10.2f}")
    result = {
        "auth_overhead_ms": figures["whoami"]["p50_ms"] - figures["healthz"]["p50_ms"],
        "list_p99_ms": figures["list"]["p99_ms"],
        "token_rps": figures["token"]["rps"],
        "list_p50_ms": figures["list"]["p50_ms"],
        "list_rps": figures["list"]["rps"],
        "token_p50_ms": figures["token"]["p50_ms"],
        "token_p99_ms": figures["token"]["p99_ms"],
        "healthz_p50_ms": figures["healthz"]["p50_ms"],
        "whoami_p50_ms": figures["whoami"]["p50_ms"],
        "concurrency": concurrency,
        "requests_per_round": num_requests,
        "rounds": rounds,
        "loadavg_1min": os.getloadavg()[0],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
