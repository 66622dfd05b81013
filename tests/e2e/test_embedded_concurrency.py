"""`make up` on the embedded defaults (SQLite, the file-system broker) under concurrent writers: scripts/up.py in a
fresh KCAAS_VAR_DIR, then several threads attaching, issuing tokens and detaching through kcaas.Client while another
creates, rotates and revokes keys, and the node agent heartbeats and reports usage every second.

Every answer is 2xx (the clients never retry: a 5xx, 503 included, is an error here), every cache reaches `ready`
and then `detached` within a bounded time, and no process logs "database is locked"."""

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import kcaas
from kcaas.errors import KcaasError
from tests.e2e.test_make_up import SPEC
from tests.faults import free_port, stop_process
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
THREADS, CYCLES, KEY_CYCLES = 4, 3, 6
SERVICE_ENV = {
    "DATABASE_URL",
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "CELERY_BROKER_TRANSPORT_OPTIONS",
    "DJANGO_SETTINGS_MODULE",
}


def start_make_up(tmp_path, port: int) -> tuple[subprocess.Popen, Path, Path]:
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV}
    env.update(
        KCAAS_VAR_DIR=str(tmp_path / "var"),
        KCAAS_PORT=str(port),
        KCAAS_NODE_DEVICE_BYTES=str(64 << 20),
        KCAAS_QUOTA_MAX_RPS="10000",
        KCAAS_NODE_HEARTBEAT_SECONDS="1",
        KCAAS_NODE_USAGE_SECONDS="1",
        KCAAS_LEASE_SWEEP_SECONDS="1",
    )
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: nothing blocks on a full pipe
        up = subprocess.Popen(
            [sys.executable, "scripts/up.py"],
            cwd=REPO,
            env=env,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    return up, out, err


def attach_detach_cycles(client: kcaas.Client, worker: int, outcomes: list, errors: list) -> None:
    """CYCLES times: attach and wait for ready, issue a data token, detach and wait for detached."""
    for cycle in range(CYCLES):
        try:
            cache = client.attach(f"c-{worker}-{cycle}", SPEC, {"device": 1 << 20}, timeout=90)
            client.issue_token(cache.id, access="readwrite")
            detached = client.detach(cache.id, wait=True, timeout=90)
            outcomes.append((cache.id, cache.state, detached.state))
        except KcaasError as exc:
            errors.append(f"thread {worker} cycle {cycle}: {exc!r}")


def key_churn(client: kcaas.Client, errors: list) -> None:
    for cycle in range(KEY_CYCLES):
        try:
            issued = client.create_key(["caches:read"], name=f"churn-{uuid.uuid4().hex[:6]}")
            successor = client.rotate_key(issued.id, overlap_seconds=0)
            client.revoke_key(successor.id)
        except KcaasError as exc:
            errors.append(f"keys cycle {cycle}: {exc!r}")


def test_concurrent_attach_detach_on_the_embedded_default(tmp_path):
    port = free_port()
    up, out, err = start_make_up(tmp_path, port)
    try:
        assert eventually(lambda: "Ctrl-C stops everything" in out.read_text() or up.poll() is not None, 180)
        assert up.poll() is None, err.read_text()[-3000:]
        api_key = re.search(r"demo API key\s+(kc_live_\S+)", out.read_text()).group(1)
        client = kcaas.Client(f"http://127.0.0.1:{port}", api_key, retries=0, timeout=30)
        outcomes, errors = [], []
        threads = [
            threading.Thread(target=attach_detach_cycles, args=(client, n, outcomes, errors)) for n in range(THREADS)
        ]
        threads.append(threading.Thread(target=key_churn, args=(client, errors)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not any(thread.is_alive() for thread in threads)
        logged = err.read_text()
        assert errors == [], "\n".join(errors) + "\n" + logged[-4000:]
        assert len(outcomes) == THREADS * CYCLES
        assert {(before, after) for _, before, after in outcomes} == {("ready", "detached")}
        assert {c.state for c in client.list_caches()} == {"detached"}
        assert "database is locked" not in logged, logged[-4000:]
        assert up.poll() is None
        client.close()
    finally:
        stop_process(up, timeout=60, sig=signal.SIGINT, group=True)
