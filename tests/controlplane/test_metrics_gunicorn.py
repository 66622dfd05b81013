"""/metrics under gunicorn with several workers and PROMETHEUS_MULTIPROC_DIR: whichever worker answers the scrape,
the counts are those of every worker (prometheus_client's multiprocess mode), as docs/observability.md says."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from tests.faults import free_port, stop_process
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]
HEALTHZ = ("kcaas_http_requests_total", (("method", "GET"), ("route", "healthz"), ("status", "200")))


def database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


@pytest.fixture
def gunicorn(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {
        **os.environ,
        "KCAAS_VAR_DIR": str(tmp_path),
        "DATABASE_URL": database_url(),  # the test database: /metrics reads the last usage report
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
    }
    port = free_port()
    command = ["gunicorn", "controlplane.wsgi:application", "--bind", f"127.0.0.1:{port}", "--workers", "3"]
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", *command, "--log-level", "warning"],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        assert eventually(lambda: _ok(port) or server.poll() is not None, timeout=60)
        assert server.poll() is None, log.read_text()[-3000:]
        yield port, metrics_dir
    finally:
        stop_process(server, timeout=15)


def _ok(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200
    except OSError:
        return False


def healthz_count(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name, tuple(sorted(sample.labels.items()))) == HEALTHZ:
                return sample.value
    return 0.0


def accept_backlog(port: int) -> int:
    """Connections waiting in the listening socket's accept queue (Linux: /proc/net/tcp, LISTEN rows)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on {port}")


def test_every_scrape_counts_the_requests_of_every_worker(gunicorn):
    """Three requests held open at once are held by the three workers (a sync worker serves one connection at a
    time), so each worker counts one; every scrape, whichever worker answers it, must count all three."""
    port, metrics_dir = gunicorn
    before = healthz_count(port)
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        for connection in held:
            connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head, not yet ended
        assert eventually(lambda: accept_backlog(port) == 0, timeout=20), "the workers did not take the requests"
        for connection in held:
            connection.sendall(b"Connection: close\r\n\r\n")
            assert connection.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for connection in held:
            connection.close()
    counts = {healthz_count(port) for _ in range(6)}  # scrapes land on different workers: all agree
    assert counts == {before + 3}
    writers = {path.name for path in metrics_dir.glob("counter_*.db")}
    assert len(writers) >= 3, writers  # one values file per worker that counted
