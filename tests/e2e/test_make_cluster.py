"""`make cluster` as a user runs it: scripts/cluster.py (up.py with two node agents) on PostgreSQL and Redis, in its own
database (created by the script, dropped here) and Redis dbs 12/13, with a private var/ dir and free ports.

The printed tenant key attaches two caches that best-fit placement must put on different nodes (each asks for more
than half a node); KV put through each node's TLS 1.3 endpoint (trusting the printed dev CA) comes back byte for
byte. Then one agent is SIGKILLed: with short heartbeat, lease and sweep periods the control plane marks its node
`lost` and its cache `failed` (node_lost) within seconds, while the other node keeps serving. The network tier's
store (a Mooncake master and store server) runs beside them: its line precedes the banner and both agents report
it healthy on /metrics (they were given its endpoints). Ctrl-C then stops every child, the store's included: no
reported pid and no process of the cluster's session is left. Without --survive-agent-loss (the
default) a dead agent stops the whole cluster instead.

The compose `bootstrap` service's command (scripts/up.py --bootstrap-only) is run here too, on PostgreSQL: it writes
what the compose agents read, and a second run reuses it.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request

import psycopg
import pytest
import torch
from psycopg import sql

import kcaas
from kcaas.dataplane import DataPlaneClient
from kcaas.tokens import TokenSource
from tests.e2e.cluster_support import LEASE_SECONDS, SPEC, admin_url, own_services, running_cluster, staff_call
from tests.e2e.up_support import (
    REPO,
    assert_all_gone,
    assert_session_gone,
    kill_session,
    reported_pids,
    start_script,
)

NETWORK_STORE_ENV = {"KCAAS_NETWORK_STORE_MASTER", "KCAAS_NETWORK_STORE_METADATA"}  # set: cluster.py starts no store

CACHE_BYTES = 160 * SPEC.block_bytes  # more than half a node: two caches cannot share one
DATABASE = f"kcaas_cluster_it_{os.getpid()}"  # two runs on one machine never share (or drop) one database
REDIS_DBS = (12, 13)  # rate limits / key usage, and the Celery broker


@pytest.fixture
def cluster_services():
    """A fresh database (cluster.py creates it) and empty Redis dbs; both cleaned up afterwards."""
    with own_services(DATABASE, REDIS_DBS) as services:
        yield services


def wait_for(predicate, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def round_trip(client: kcaas.Client, cache, ca_file: str, seed: int) -> None:
    """Put 48 tokens of KV through the cache's TLS endpoint, get them back: the same bytes."""
    tls = ssl.create_default_context(cafile=ca_file)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (48,), generator=generator)
    kv = torch.randn(SPEC.num_layers, 2, 48, SPEC.num_kv_heads, SPEC.head_dim, generator=generator).half()
    with DataPlaneClient(
        cache.endpoint, TokenSource(client, cache.id, access="readwrite"), cache.id, SPEC, ssl_context=tls, timeout=10.0
    ) as dp:
        assert dp.put(tokens, kv)["num_cached"] == 48
        assert dp.lookup(tokens) == 48
        n, back = dp.get(tokens)
        assert n == 48 and back.dtype == torch.float16
        assert back.contiguous().view(torch.uint8).numpy().tobytes() == kv.view(torch.uint8).numpy().tobytes()


def test_make_cluster_places_on_two_nodes_sees_one_lost_and_stops_cleanly(tmp_path, cluster_services):
    started = time.monotonic()
    with running_cluster(tmp_path, cluster_services, "--survive-agent-loss") as (cluster, banner, output, ports):
        port, node_port, metrics_port = ports
        up_seconds = time.monotonic() - started
        api_key = re.search(r"demo API key\s+(kc_live_\S+)", banner).group(1)
        password = re.search(r"admin login\s+admin / (\S+)", banner).group(1)
        ca_file = re.search(r"dev CA: ([^)\s]+)\)", banner).group(1)
        nodes = dict(re.findall(r"node (local-cpu\S*)\s+(\S+) \(TLS 1.3 data plane\)", banner))
        assert nodes == {"local-cpu": f"127.0.0.1:{node_port}", "local-cpu-2": f"127.0.0.1:{node_port + 1}"}
        pids = reported_pids(banner, agents=2)
        store = re.search(
            r"network store\s+master (127\.0\.0\.1:\d+), metadata (http://127\.0\.0\.1:\d+/metadata)", banner
        )
        assert store, banner
        store_pids = {name: int(pid) for name, pid in re.findall(r"(\S+)=(\d+)", banner.split("store pids", 1)[1])[:2]}
        assert set(store_pids) == {"master", "store-server-0"}
        for index in (0, 1):
            assert f"http://127.0.0.1:{metrics_port + index}/metrics" in banner
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + index}/metrics", timeout=5) as metrics:
                assert metrics.status == 200
                # the agent was given the store's endpoints and reaches it
                assert re.search(r"^kcaas_node_network_store_healthy 1\.0$", metrics.read().decode(), re.M)

        with kcaas.Client(f"http://127.0.0.1:{port}", api_key) as client:
            # two caches that each take more than half a node: best fit must use both nodes
            first = client.attach("first", SPEC, {"device": CACHE_BYTES}, timeout=60)
            second = client.attach("second", SPEC, {"device": CACHE_BYTES}, timeout=60)
            assert first.is_ready and second.is_ready
            assert {first.endpoint, second.endpoint} == set(nodes.values())
            assert first.node_id != second.node_id
            round_trip(client, first, ca_file, seed=1)
            round_trip(client, second, ca_file, seed=2)

            # SIGKILL the agent holding the second cache: its node is marked lost, its cache failed (node_lost)
            victim = "agent-1" if second.endpoint == nodes["local-cpu"] else "agent-2"
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.monotonic()
            lost = wait_for(
                lambda: (c := client.get_cache(second.id)).state == "failed" and c,
                timeout=LEASE_SECONDS + 20,
                what="the cache on the killed node to fail",
            )
            lost_seconds = time.monotonic() - killed
            assert lost.failure_reason == "node_lost"
            node = staff_call(f"http://127.0.0.1:{port}/api/v1/admin/nodes/{second.node_id}", password)
            assert node["state"] == "lost" and node["reserved"]["device"] == 0
            survivor = staff_call(f"http://127.0.0.1:{port}/api/v1/admin/nodes/{first.node_id}", password)
            assert survivor["state"] == "ready"
            assert client.get_cache(first.id).is_ready
            round_trip(client, first, ca_file, seed=3)  # the other node still serves
            assert cluster.poll() is None  # --survive-agent-loss: one agent's death does not stop the cluster

        # Ctrl-C stops every child
        cluster.send_signal(signal.SIGINT)
        assert cluster.wait(timeout=60) == 0
        wait_for(lambda: "stopped" in "".join(output), timeout=10, what="the output thread to read the last line")
        assert_all_gone(pids)
        assert_all_gone(store_pids)
    print(
        f"cluster up in {up_seconds:.1f} s; node lost seen {lost_seconds:.1f} s after SIGKILL; "
        f"whole test {time.monotonic() - started:.1f} s"
    )


def test_by_default_a_dead_agent_stops_the_whole_cluster(tmp_path, cluster_services):
    with running_cluster(tmp_path, cluster_services) as (cluster, banner, output, _):
        pids = reported_pids(banner, agents=2)
        os.kill(pids["agent-2"], signal.SIGKILL)
        assert cluster.wait(timeout=60) == 0  # it stops on its own
        wait_for(lambda: "stopped" in "".join(output), timeout=10, what="the output thread to read the last line")
        cluster.stderr_file.seek(0)
        assert "agent-2 stopped: stopping the rest" in cluster.stderr_file.read()
        assert_all_gone(pids)


def test_sigterm_before_the_banner_stops_the_network_store(tmp_path, cluster_services):
    """The store starts first: a SIGTERM before up.py is up still stops its processes (nothing of the session is
    left), and the script exits 130 without a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in {"DJANGO_SETTINGS_MODULE", *NETWORK_STORE_ENV}}
    env.update(cluster_services, KCAAS_VAR_DIR=str(tmp_path / "var"))
    with open(tmp_path / "cluster.stderr", "w+") as stderr:
        cluster = start_script("cluster.py", env, stderr)
        try:
            line = cluster.stdout.readline()
            store_pids = {name: int(pid) for name, pid in re.findall(r"(\S+)=(\d+)", line.split("store pids", 1)[1])}
            assert set(store_pids) == {"master", "store-server-0"}, line
            cluster.send_signal(signal.SIGTERM)
            assert cluster.wait(timeout=60) == 130
        finally:
            kill_session(cluster)
        stderr.seek(0)
        assert "Traceback" not in stderr.read()
    assert_all_gone(store_pids)
    assert_session_gone(cluster)


def test_bootstrap_only_makes_what_the_compose_agents_read(tmp_path, cluster_services):
    """The compose `bootstrap` service's command, on PostgreSQL: node credentials and certificates (valid for the
    compose service names) in their own directory, the CA key outside it; a second run reuses everything."""
    from cryptography import x509

    with psycopg.connect(admin_url(DATABASE), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(cluster_services)
    node_dir = tmp_path / "nodes"
    env.update(
        KCAAS_VAR_DIR=str(tmp_path / "var"),
        KCAAS_AGENTS="2",
        KCAAS_NODE_SECRETS_DIR=str(node_dir),
        KCAAS_DEV_TLS_HOSTS="agent-1,agent-2",
    )
    command = [sys.executable, "scripts/up.py", "--bootstrap-only", "--require-services"]
    made, logins = [], []
    for _ in range(2):
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        assert re.search(r"demo API key kc_live_\S+", run.stdout) and "local-cpu-2 (node-credential-2)" in run.stdout
        logins.append(re.search(r"admin / (\S+);", run.stdout).group(1))
        made.append({path.name: path.read_bytes() for path in node_dir.iterdir()})
    assert made[0] == made[1] and logins[0] == logins[1]  # a second run reuses the credentials and certificates

    assert sorted(path.name for path in node_dir.iterdir()) == [
        "node-2-tls.key",
        "node-2-tls.pem",
        "node-credential",
        "node-credential-2",
        "node-tls.key",
        "node-tls.pem",
    ]
    for name in ("node-credential", "node-credential-2", "node-tls.key", "node-2-tls.key"):
        assert (node_dir / name).stat().st_mode & 0o777 == 0o600
    credentials = {(node_dir / name).read_text() for name in ("node-credential", "node-credential-2")}
    assert len(credentials) == 2 and all(c.startswith("kc_node_") for c in credentials)
    ca = x509.load_pem_x509_certificate((tmp_path / "var" / "secrets" / "dev-ca.pem").read_bytes())
    assert (tmp_path / "var" / "secrets" / "dev-ca.key").is_file()
    serials = set()
    for name in ("node-tls.pem", "node-2-tls.pem"):
        cert = x509.load_pem_x509_certificate((node_dir / name).read_bytes())
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {"agent-1", "agent-2", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
        serials.add(cert.serial_number)
    assert len(serials) == 2  # one certificate per agent
