"""devtools.store_services: the network tier's store processes (a Mooncake master and store servers) as real
processes, through a real pure client (no segment of its own, as a GPU node agent is): objects go in and come back;
a killed store server takes its objects with it (misses, not errors); a stopped master answers nothing until resumed
and then serves what it held; stop() leaves no process, also after the master was killed; `python -m
devtools.store_services` prints the agents' env lines and stops everything on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from devtools.store_services import MASTER_ENV, METADATA_ENV, MIB, StoreServices
from tests.network_store import require_mooncake
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pure_client():
    """Makes pure clients (no segment) on given endpoints; closes them after the test."""
    clients = []

    def connect(endpoints):
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", endpoints.metadata_url, 0, 16 * MIB, "tcp", "", endpoints.master) == 0
        clients.append(store)
        return store

    yield connect
    for store in clients:
        store.close()


def key() -> str:
    return f"test-store-services/{uuid.uuid4().hex}"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_pure_client_puts_gets_and_removes_through_the_store(network_store, pure_client):
    client = pure_client(network_store)
    name, payload = key(), os.urandom(2 * MIB)
    assert client.put(name, payload) == 0
    assert client.is_exist(name) == 1
    assert client.get(name) == payload
    client.remove(name, True)
    assert client.is_exist(name) == 0
    assert client.get(name) == b""
    assert network_store.master.startswith("127.0.0.1:") and network_store.metadata_url.endswith("/metadata")
    assert network_store.env() == {MASTER_ENV: network_store.master, METADATA_ENV: network_store.metadata_url}


def test_a_killed_store_server_takes_its_objects_with_it(fresh_network_store, pure_client):
    client = pure_client(fresh_network_store.endpoints)
    name, payload = key(), os.urandom(MIB)
    assert client.put(name, payload) == 0 and client.get(name) == payload

    fresh_network_store.kill_store_server(0)

    assert gone(fresh_network_store.endpoints.store_server_pids[0])
    assert client.get(name) == b""  # the bytes were in the dead server's segment: a miss, not an error
    # the master notices the missing heartbeats (client_ttl 2 s) and forgets the object and the segment
    assert eventually(lambda: client.is_exist(name) == 0, timeout=30)
    assert eventually(lambda: fresh_network_store.capacity_bytes() == 0, timeout=30)


def test_a_stopped_master_answers_nothing_until_resumed(fresh_network_store, pure_client):
    client = pure_client(fresh_network_store.endpoints)
    name, payload = key(), os.urandom(MIB)
    assert client.put(name, payload) == 0

    fresh_network_store.stop_master()
    assert fresh_network_store.health(timeout=0.5) is None
    fresh_network_store.resume_master()

    assert fresh_network_store.health()["service_ready"] is True
    assert client.get(name) == payload
    second = key()
    assert client.put(second, b"after the pause") == 0 and client.get(second) == b"after the pause"


def test_stop_leaves_no_process_also_after_the_master_was_killed(tmp_path):
    require_mooncake()
    services = StoreServices(tmp_path, segment_bytes=32 * MIB, num_store_servers=2)
    try:
        endpoints = services.start()
        assert len(endpoints.store_server_pids) == 2
        assert services.capacity_bytes() == 2 * 32 * MIB
        services.kill_master()
        assert gone(endpoints.master_pid)
    finally:
        services.stop()
    assert services.pids() == []
    assert all(gone(pid) for pid in (endpoints.master_pid, *endpoints.store_server_pids))
    assert {"master.log", "store-server-0.log", "store-server-1.log"} <= {p.name for p in tmp_path.iterdir()}
    services.stop()  # idempotent


def test_the_foreground_run_prints_the_agents_env_and_stops_on_sigterm(tmp_path):
    require_mooncake()
    command = [sys.executable, "-m", "devtools.store_services", "--workdir", str(tmp_path), "--segment-bytes"]
    run = subprocess.Popen(
        [*command, str(32 * MIB)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = dict(run.stdout.readline().strip().split("=", 1) for _ in range(2))
        assert re.fullmatch(r"127\.0\.0\.1:\d+", lines[MASTER_ENV])
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metadata", lines[METADATA_ENV])
        pids = [int(pid) for pid in re.findall(r"\d+", run.stderr.readline().split("metrics")[0])]
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 0
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert pids and all(gone(pid) for pid in pids)
