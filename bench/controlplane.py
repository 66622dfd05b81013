"""Control-plane latency and throughput against a real server: gunicorn + PostgreSQL + Redis, load from loopback.

    python -m bench.controlplane [--quick]

Sets up (through the services, in a database of its own, `kcaas_bench`) a tenant with a high rate limit, a key, the
bench's node (one node, `bench-node`, kept across runs and registered again by each) and ready caches, starts
gunicorn (gthread workers, keep-alive) on a free loopback port, a control-plane Celery worker on the `control` queue
and a stand-in node agent on the node's queue, and drives four operations with keep-alive connections from client
threads:
    GET /healthz                      no authentication, no database (the floor)
    GET /api/v1/whoami                authenticated (key lookup, hash check, rate limit, usage counter)
    GET /api/v1/caches                authenticated list (one page of the tenant's caches)
    POST /api/v1/caches/{id}/tokens   data-plane token issue (tenant lock, outstanding count, Ed25519 signature)
and, one at a time from one connection, attach:
    POST /api/v1/caches               quota under the tenant lock, placement, the row, the order in the outbox
                                      (attach_p50_ms, attach_p99_ms: until the 201 answer, state provisioning)
    ... then GET /api/v1/caches/{id}  polled until `ready` (attach_ready_p50_ms, attach_ready_p99_ms): the order
                                      published to the broker, the stand-in node's answer at once (no pool is
                                      allocated: the control plane's share of attach), the control worker's update
Figures (last line, JSON): auth_overhead_ms (whoami p50 - healthz p50), list_p99_ms, token_rps, attach_p50_ms,
attach_p99_ms, and more. The client threads share the 2 cores with the server: read the figures as this machine's,
side by side.

Reruns: every run registers the same node again (a node re-registering is an agent restart, allowed at any time),
cordons any other live node in the bench database (nodes of older runs of this bench: a cache placed on one of them
was never answered, and its token issue failed with 409 cache_not_ready when a rerun came within a node lease) and
detaches, as that node, every cache an earlier run left on it, so reservations do not pile up.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_DB = "kcaas_bench"
BENCH_NODE = "bench-node"
BENCH_NODE_ENDPOINT = "127.0.0.1:47470"  # never dialled: the stand-in node answers through the broker only
NODE_CAPACITY = {"device": 2**40, "dram": 2**40, "ssd": 2**40}
ATTACH_CAPACITY = {"device": 64 << 20, "dram": 0, "ssd": 0}
HEARTBEAT_SECONDS = 10.0  # the stand-in node renews its lease (40 s by default) as an agent does


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


def migrate() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def bench_node():
    """The bench's one node, created on the first run and registered again by every run (as an agent does when it
    restarts). Any other live node in the bench database is cordoned, so placement can only choose this one."""
    from fleet import services as fleet_services
    from fleet.models import Node, NodeState

    node = Node.objects.filter(name=BENCH_NODE).first()
    if node is None:
        node = fleet_services.node_create(name=BENCH_NODE).node
    from kcaas.node_protocol.sealing import NodeSealingKey

    # The stand-in agent reads no key, but orders carrying keys go only to a node that registered a sealing key.
    fleet_services.node_register(
        node_id=node.id,
        endpoint=BENCH_NODE_ENDPOINT,
        capacity=NODE_CAPACITY,
        sealing_public_key=NodeSealingKey().public_key_b64,
    )
    for other in Node.objects.filter(state=NodeState.READY).exclude(pk=node.pk).values_list("pk", flat=True):
        fleet_services.node_cordon(node_id=other)
    return Node.objects.get(pk=node.pk)


def release_caches(*, node_id, tenant_id=None) -> int:
    """Detach every cache placed on the node (of one tenant, or any) that still holds a reservation, confirming
    each detach as the node would: its reservation goes back. Returns how many."""
    from caches import services as cache_services
    from caches.models import RESERVING_STATES, Cache

    caches = Cache.objects.filter(node_id=node_id, state__in=RESERVING_STATES)
    if tenant_id is not None:
        caches = caches.filter(tenant_id=tenant_id)
    cache_ids = list(caches.values_list("pk", flat=True))
    for cache_id in cache_ids:
        cache_services.cache_detach(cache_id=cache_id, tenant_id=None)
        cache_services.cache_detach_result(cache_id=cache_id, node_id=node_id)
    return len(cache_ids)


@dataclass
class BenchSetup:
    raw_key: str
    tenant_id: uuid.UUID
    node_id: uuid.UUID
    cache_ids: list[str]
    released: int  # caches earlier runs left on the node, detached by this one


def set_up(num_caches: int, max_caches: int) -> BenchSetup:
    """A fresh tenant (rate limit lifted, room for `max_caches`), its key, the bench node and `num_caches` ready
    caches. Safe to run again at once: see the module docstring."""
    from caches import services as cache_services
    from kcaas.spec import KVCacheSpec
    from tenants import services as tenant_services

    node = bench_node()
    released = release_caches(node_id=node.pk)
    run = uuid.uuid4().hex[:8]
    tenant = tenant_services.tenant_create(name=f"bench-{run}")
    tenant_services.quota_update(
        tenant=tenant,
        max_requests_per_second=100_000,
        max_data_tokens_outstanding=1_000_000,
        max_caches=max_caches,
        max_device_bytes=NODE_CAPACITY["device"],
    )
    key = tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read", "caches:write"]).raw_key
    spec = KVCacheSpec("bench-model@1", 32, 8, 128, 16, "float16", "float16")
    cache_ids = []
    for index in range(num_caches):
        cache = cache_services.cache_attach(
            tenant_id=tenant.id, name=f"cache-{index}", spec=spec, capacity={"device": 2**30}
        )
        assert cache.node_id == node.pk, "placement chose another node than the bench's"
        ready = cache_services.cache_provision_result(cache_id=cache.id, node_id=cache.node_id, ok=True)
        assert ready.state == "ready", ready.state
        cache_ids.append(str(cache.id))
    return BenchSetup(key, tenant.id, node.pk, cache_ids, released)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(env: dict, port: int) -> subprocess.Popen:
    server_env = {**os.environ, **env, "PYTHONPATH": f"{REPO / 'platform'}:{REPO}"}
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "controlplane.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--workers",
        "2",
        "--worker-class",
        "gthread",
        "--threads",
        "4",
        "--keep-alive",
        "30",
        "--log-level",
        "warning",
        "--chdir",
        str(REPO),
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


def start_control_worker(env: dict, log) -> subprocess.Popen:
    """The control plane's Celery worker on the `control` queue: it records the node's answers (ready, detached)."""
    worker_env = {**os.environ, **env, "PYTHONPATH": f"{REPO / 'platform'}:{REPO}"}
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "worker",
        "-Q",
        "control",
        "-P",
        "solo",
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "-l",
        "warning",
    ]
    return subprocess.Popen(command, env=worker_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)


def stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class StandInNode(threading.Thread):
    """The node agent's side of attach and detach for the bench node: it consumes the node's queue and answers each
    provisioning (ok, at once: no pool is allocated) and detach on the `control` queue, as the agent does; it
    renews the node's lease every HEARTBEAT_SECONDS (through the fleet service, as the agent's heartbeat would)."""

    def __init__(self, broker_url: str, node_id, endpoint: str):
        super().__init__(name="bench-stand-in-node", daemon=True)
        self.broker_url, self.node_id, self.endpoint = broker_url, str(node_id), endpoint
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.answered = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        from celery import Celery
        from django.db import connection as database
        from kombu import Connection, Consumer, Exchange, Queue

        from fleet import services as fleet_services
        from kcaas.node_protocol.messages import (
            CONTROL_QUEUE,
            DetachCache,
            DetachResult,
            ProvisionCache,
            ProvisionResult,
            message_class,
            node_queue,
        )

        sender = Celery("kcaas-bench-node", broker=self.broker_url)
        sender.conf.update(task_serializer="json", accept_content=["json"])
        name = node_queue(self.node_id)
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name)

        def send(reply) -> None:
            sender.send_task(reply.TASK, kwargs=reply.to_dict(), queue=CONTROL_QUEUE)

        def answer(body, message) -> None:
            order = message_class(message.headers.get("task")).from_call(body[0], body[1])
            if isinstance(order, ProvisionCache):
                send(
                    ProvisionResult(
                        cache_id=order.cache_id, node_id=self.node_id, ok=True, reason="", endpoint=self.endpoint
                    )
                )
            elif isinstance(order, DetachCache):
                send(DetachResult(cache_id=order.cache_id, node_id=self.node_id))
            message.ack()
            self.answered += 1

        try:
            with Connection(self.broker_url) as broker, Consumer(broker, [queue], callbacks=[answer], accept=["json"]):
                self.ready.set()
                next_heartbeat = time.monotonic() + HEARTBEAT_SECONDS
                while not self.stopping.is_set():
                    try:
                        broker.drain_events(timeout=0.1)
                    except TimeoutError:
                        pass
                    if time.monotonic() >= next_heartbeat:
                        fleet_services.node_heartbeat(node_id=uuid.UUID(self.node_id), capacity=NODE_CAPACITY)
                        next_heartbeat += HEARTBEAT_SECONDS
        except BaseException as exc:  # noqa: BLE001 - reported by main
            self.error = exc
        finally:
            self.ready.set()
            database.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


def _json_call(
    connection: http.client.HTTPConnection, method: str, path: str, headers: dict, body: bytes | None = None
) -> tuple[int, dict]:
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    return response.status, (json.loads(payload) if payload else {})


@contextlib.contextmanager
def attach_connection(port: int):
    """A keep-alive connection for a round of attaches, opened (and used once) before the first is timed."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        _json_call(connection, "GET", "/healthz", {})
        yield connection
    finally:
        connection.close()


def attach_once(
    connection: http.client.HTTPConnection,
    raw_key: str,
    name: str,
    *,
    ready_timeout: float,
    poll_seconds: float = 0.005,
) -> tuple[float, float]:
    """POST /api/v1/caches, then GET the cache until it is ready: (seconds until the 201, seconds until ready)."""
    from kcaas.spec import KVCacheSpec

    auth = {"Authorization": f"Bearer {raw_key}"}
    spec = KVCacheSpec("bench-model@1", 32, 8, 128, 16, "float16", "float16").to_dict()
    body = json.dumps({"name": name, "spec": spec, "capacity": ATTACH_CAPACITY}).encode()
    begin = time.perf_counter()
    status, attached = _json_call(
        connection, "POST", "/api/v1/caches", {**auth, "Content-Type": "application/json"}, body
    )
    answered = time.perf_counter() - begin
    if status != 201:
        raise SystemExit(f"attach: HTTP {status} {attached}")
    while True:
        status, cache = _json_call(connection, "GET", f"/api/v1/caches/{attached['id']}", auth)
        if status == 200 and cache["state"] == "ready":
            return answered, time.perf_counter() - begin
        if status != 200 or cache["state"] != "provisioning":
            raise SystemExit(f"attach: the cache became HTTP {status} {cache}")
        if time.perf_counter() - begin > ready_timeout:
            raise SystemExit(f"attach: not ready after {ready_timeout:.0f} s (is the control worker running?)")
        time.sleep(poll_seconds)


def percentile(sorted_values: list[float], fraction: float) -> float:
    """The value at `fraction` of a sorted list (nearest rank, as drive() reports p99)."""
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * fraction))]


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
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "requests": len(latencies),
    }


def operations(raw_key: str, cache_id: str) -> list[Operation]:
    auth = {"Authorization": f"Bearer {raw_key}"}
    return [
        Operation("healthz", "GET", "/healthz", {}),
        Operation("whoami", "GET", "/api/v1/whoami", auth),
        Operation("list", "GET", "/api/v1/caches?limit=20", auth),
        Operation(
            "token",
            "POST",
            f"/api/v1/caches/{cache_id}/tokens",
            {**auth, "Content-Type": "application/json"},
            json.dumps({"access": "read"}).encode(),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (well under a minute)")
    args = parser.parse_args(argv)
    num_requests, concurrency, rounds = (400, 4, 3) if args.quick else (3000, 8, 5)
    attaches_per_round, warmup_attaches = (10, 3) if args.quick else (40, 5)
    num_caches = 10
    env = services_env()
    os.environ.update(env)
    sys.path[:0] = [str(REPO / "platform"), str(REPO)]
    ensure_database(env["DATABASE_URL"])
    migrate()
    setup = set_up(num_caches, max_caches=num_caches + warmup_attaches + rounds * attaches_per_round)
    port = free_port()
    server = worker = node = None
    attach_s: list[float] = []
    ready_s: list[float] = []
    run = uuid.uuid4().hex[:8]
    with tempfile.TemporaryFile() as worker_log:
        try:
            worker = start_control_worker(env, worker_log)
            node = StandInNode(env["CELERY_BROKER_URL"], setup.node_id, BENCH_NODE_ENDPOINT)
            node.start()
            server = start_server(env, port)
            node.ready.wait(30)
            if node.error is not None:
                raise SystemExit(f"the stand-in node failed: {node.error!r}")
            ops = operations(setup.raw_key, setup.cache_ids[0])
            for op in ops:  # warm up: connections, workers' imports, query plans
                drive(port, op, concurrency * 10, concurrency)
            with attach_connection(port) as attacher:
                for index in range(warmup_attaches):  # the first waits for the control worker to come up
                    attach_once(attacher, setup.raw_key, f"attach-{run}-warmup-{index}", ready_timeout=60)
            runs: dict[str, list[dict]] = {op.name: [] for op in ops}
            for round_index in range(rounds):  # interleaved rounds: the machine's noise falls on every operation alike
                for op in ops:
                    runs[op.name].append(drive(port, op, num_requests, concurrency))
                with attach_connection(port) as attacher:  # a new one: the server closes a connection idle for 30 s
                    for index in range(attaches_per_round):
                        answered, ready = attach_once(
                            attacher, setup.raw_key, f"attach-{run}-{round_index}-{index}", ready_timeout=20
                        )
                        attach_s.append(answered)
                        ready_s.append(ready)
        except BaseException:
            if worker is not None and worker.poll() is not None:
                worker_log.seek(0)
                print(f"control worker exited: {worker_log.read().decode()[-2000:]}", file=sys.stderr)
            raise
        finally:
            stop(server)
            if node is not None:
                node.stop()
            stop(worker)
            release_caches(node_id=setup.node_id, tenant_id=setup.tenant_id)  # this run's reservations back
            import redis

            redis.Redis.from_url(env["CELERY_BROKER_URL"]).flushdb()  # orders nobody needs to answer any more
    figures = {
        name: {k: statistics.median(r[k] for r in results) for k in results[0]} for name, results in runs.items()
    }
    attach_s.sort()
    ready_s.sort()
    print(
        f"bench.controlplane ({'quick' if args.quick else 'full'}): gunicorn 2 gthread workers x 4 threads, "
        f"{concurrency} keep-alive client connections, median of {rounds} rounds of {num_requests} requests; "
        f"{len(attach_s)} attaches one at a time"
    )
    print(f"  {'operation':<14}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for name, values in figures.items():
        print(f"  {name:<14}{values['rps']:>10.0f}{values['p50_ms']:>10.2f}{values['p99_ms']:>10.2f}")
    attach_rows = {"attach": attach_s, "attach->ready": ready_s}
    for name, values in attach_rows.items():
        print(
            f"  {name:<14}{len(values) / sum(values):>10.1f}{statistics.median(values) * 1e3:>10.2f}"
            f"{percentile(values, 0.99) * 1e3:>10.2f}"
        )
    print(
        "  attach: POST /api/v1/caches until 201; attach->ready: until GET shows ready (a stand-in node answers "
        "at once, a real control worker records it; polled every 5 ms)"
    )
    print(
        f"  node {BENCH_NODE} registered again; caches earlier runs left on it, released at the start: "
        f"{setup.released}; this run's {num_caches + warmup_attaches + len(attach_s)}, released at the end"
    )
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
        "attach_p50_ms": statistics.median(attach_s) * 1e3,
        "attach_p99_ms": percentile(attach_s, 0.99) * 1e3,
        "attach_ready_p50_ms": statistics.median(ready_s) * 1e3,
        "attach_ready_p99_ms": percentile(ready_s, 0.99) * 1e3,
        "attach_samples": len(attach_s),
        "released_caches_of_earlier_runs": setup.released,
        "concurrency": concurrency,
        "requests_per_round": num_requests,
        "rounds": rounds,
        "loadavg_1min": os.getloadavg()[0],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
