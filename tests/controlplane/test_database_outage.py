"""A PostgreSQL outage under load: the control plane answers 503 `database_unavailable` with Retry-After (never a
500) while its database is down, serves again once it is back, and an SDK call made during the outage succeeds by
retrying.

Everything is real and of this test's own: a PostgreSQL cluster (tests/faults.PrivatePostgres), migrated and given a
tenant key by manage.py, and gunicorn serving controlplane.wsgi (one gthread worker, as `make up` runs it) on a free
port; Redis is the tests' (REDIS_URL). A few threads GET /api/v1/caches and /api/v1/whoami while the database is
stopped (fast shutdown: every session is cut) until the load and the SDK have both met the outage, then started."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kcaas
from tests.faults import PrivatePostgres, free_port, stop_process
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
PATHS = ("/api/v1/caches", "/api/v1/whoami")
LOAD_THREADS = 3

pytestmark = pytest.mark.skipif(PrivatePostgres.available() is not None, reason=str(PrivatePostgres.available()))


@dataclass
class ControlPlane:
    url: str
    port: int
    api_key: str
    database: PrivatePostgres
    log: Path


def _manage(env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"manage.py {args[0]} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def _healthy(port: int) -> bool:
    try:
        return _get(port, "/healthz", None)[0] == 200
    except OSError:
        return False


def _get(port: int, path: str, api_key: str | None) -> tuple[int, dict, object]:
    """One GET on a fresh connection: (status, lower-cased headers, parsed JSON body or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw[:500]
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    var = tmp_path_factory.mktemp("outage-var")
    with PrivatePostgres() as database:
        env = {
            **os.environ,
            "DATABASE_URL": database.create_database("kcaas"),
            "KCAAS_VAR_DIR": str(var),
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "KCAAS_QUOTA_MAX_RPS": "100000",
            "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
        }
        _manage(env, "migrate", "--noinput")
        api_key = _manage(env, "kcaas_create_tenant", "outage-tenant").split()[0]
        port = free_port()
        log = var / "gunicorn.log"
        with open(log, "wb") as sink:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "controlplane.wsgi:application",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--workers",
                    "1",
                    "--worker-class",
                    "gthread",
                    "--threads",
                    "4",
                    "--graceful-timeout",
                    "2",
                    "--log-level",
                    "warning",
                ],
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            assert eventually(lambda: _healthy(port) or server.poll() is not None, timeout=60)
            assert server.poll() is None, log.read_text()[-3000:]
            yield ControlPlane(f"http://127.0.0.1:{port}", port, api_key, database, log)
        finally:
            stop_process(server, timeout=15)


@dataclass
class Load:
    """Threads that GET the API until stopped, recording (phase, status, headers, body) for every answer; a
    request that got no answer is recorded with status None."""

    plane: ControlPlane
    phase: str = "before"
    answers: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list = field(default_factory=list)

    def start(self) -> None:
        for index in range(LOAD_THREADS):
            thread = threading.Thread(target=self._run, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, index: int) -> None:
        count = 0
        while not self.stop.is_set():
            phase, path = self.phase, PATHS[(index + count) % len(PATHS)]
            try:
                status, headers, body = _get(self.plane.port, path, self.plane.api_key)
            except OSError as exc:
                status, headers, body = None, {}, repr(exc)
            self.answers.append((phase, status, headers, body))
            count += 1
            self.stop.wait(0.02)  # pacing only: a few dozen requests a second in all

    def count(self, phase: str, status: int) -> int:
        return sum(1 for p, s, _, _ in list(self.answers) if p == phase and s == status)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


class OutageCall(threading.Thread):
    """One SDK call (default retry settings) started during the outage; its waits are recorded, then really slept."""

    def __init__(self, plane: ControlPlane):
        super().__init__(daemon=True)
        self.client = kcaas.Client(plane.url, plane.api_key)
        self.waits: list[float] = []
        self.client._sleep = lambda seconds: (self.waits.append(seconds), time.sleep(seconds))
        self.result = self.error = None

    def run(self) -> None:
        try:
            self.result = self.client.whoami()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.client.close()


def test_a_database_outage_answers_503_then_recovers(control_plane):
    load = Load(control_plane)
    load.start()
    try:
        assert eventually(lambda: load.count("before", 200) >= 5, timeout=30), _summary(load, control_plane)
        load.phase = "outage"
        control_plane.database.stop()
        assert eventually(lambda: load.count("outage", 503) >= 5, timeout=20), _summary(load, control_plane)
        call = OutageCall(control_plane)
        call.start()
        assert eventually(lambda: len(call.waits) >= 2, timeout=20), "the SDK call never met the outage"
        load.phase = "after"
        control_plane.database.start()
        call.join(40)
        assert not call.is_alive() and call.error is None, f"the SDK call failed: {call.error!r}"
        assert call.result.kind == "tenant_key"
        assert eventually(lambda: load.count("after", 200) >= 10, timeout=30), _summary(load, control_plane)
    finally:
        load.finish()

    answers = list(load.answers)
    assert not [a for a in answers if a[1] is None], _summary(load, control_plane)  # it stayed up throughout
    for phase, status, headers, body in answers:
        if status is not None and status >= 500:
            assert status == 503 and headers.get("retry-after") == "2", (phase, status, headers, body)
            assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}, body
            assert body["error"]["code"] == "database_unavailable", body
    assert all(status == 200 for _, status, _, _ in answers[-LOAD_THREADS:]), _summary(load, control_plane)
    assert all(w >= 2.0 for w in call.waits)  # the SDK waited as the 503s' Retry-After asked


def _summary(load: Load, plane: ControlPlane) -> str:
    counts: dict = {}
    for phase, status, _, _ in list(load.answers):
        counts[(phase, status)] = counts.get((phase, status), 0) + 1
    odd = [a for a in list(load.answers) if a[1] not in (200, 503)][:3]
    return f"answers {counts}, odd {odd}\n{plane.log.read_text()[-2000:]}{plane.database.server_log()}"
