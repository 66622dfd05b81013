"""Servers of a test's own, to break on purpose: `PrivateRedis` (a redis-server) and `PrivatePostgres` (a
PostgreSQL 15 cluster), each on a free loopback port, stoppable and restartable with their data, and always stopped
by `close()` (a context manager, and at interpreter exit as a last resort).

PostgreSQL refuses to run as root: when the tests run as root, initdb and pg_ctl run as the `postgres` user
(`runuser -u postgres --`) on a directory that user owns. `PrivatePostgres.available()` says why one cannot be made
(no binaries, no such user), so a test can skip cleanly.

Also the small helpers those tests share: `free_port`, `listening`, `stop_process` (a child asked to stop, then
killed) and `start_calls` (calls run from threads, their results or exceptions collected).
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from tests.waiting import eventually

_redis_databases = itertools.count(1)


def free_port(neighbours: int = 2) -> int:
    """A loopback TCP port nobody listens on right now (the OS picks it), whose next `neighbours` ports are free too:
    `make up` puts its agents' data planes on the API's port + 1, + 2, and the session's network store holds ports
    of its own for the whole run."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + neighbours <= 65535 and all(_bindable(port + i) for i in range(1, neighbours + 1)):
            return port
    raise RuntimeError(f"no free port with {neighbours} free ports after it")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening(port: int) -> bool:
    """True when something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_process(
    process: subprocess.Popen, timeout: float = 20, *, sig: int = signal.SIGTERM, group: bool = False
) -> None:
    """Stop a child process: `sig` (SIGTERM unless told), up to `timeout` seconds for it to exit, then SIGKILL (to
    its whole process group when `group`: a child started with start_new_session=True, with its own children) and
    reap it. A no-op for a process that has exited already."""
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait(timeout=10)


def start_calls(calls, *, daemon: bool = True) -> tuple[list[threading.Thread], list]:
    """Each of `calls` (no-argument functions) in a thread of its own, all started now: returns (threads, results),
    where results[i] becomes what calls[i] returned, or the exception it raised, once its thread ends (None until
    then)."""
    results: list = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as error:  # noqa: BLE001 - reported by the caller
            results[i] = error

    threads = [threading.Thread(target=run, args=(i, c), daemon=daemon) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    return threads, results


class PrivateRedis:
    """A redis-server of this test's own (port, data dir: append-only file, fsync always), restartable with its
    data. Each one uses another database number too: a port freed by an earlier test can be handed out again, and
    nothing from that test (a worker still reconnecting) may then see this test's keys."""

    def __init__(self, directory: Path | None = None):
        self._own_directory = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="kcaas-redis-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/{next(_redis_databases) % 16}"
        self.process: subprocess.Popen | None = None
        atexit.register(self.close)

    @staticmethod
    def available() -> str | None:
        """None when a server can be made, else the reason it cannot."""
        return None if shutil.which("redis-server") else "needs redis-server"

    def start(self) -> None:
        import redis

        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        try:
            assert eventually(lambda: _redis_answers(client), timeout=10), "redis did not start"
        finally:
            client.close()

    def stop(self) -> None:
        """A clean shutdown (SIGTERM: the append-only file is fsynced); a no-op when not running."""
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop it and, if this object made its directory, remove that. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _redis_answers(client) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _postgres_bindir() -> Path | None:
    """PostgreSQL 15's server binaries, else the newest installed."""
    found = glob.glob("/usr/lib/postgresql/15/bin/pg_ctl") or sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: _major(Path(p).parts[-3])
    )
    return Path(found[-1]).parent if found else None


def _major(version: str) -> int:
    return int(version) if version.isdigit() else 0


class PrivatePostgres:
    """A PostgreSQL cluster of this test's own: initdb into a fresh temporary directory, superuser `postgres`, trust
    authentication, TCP on 127.0.0.1:<free port> only (its socket directory is its own). Durability settings are off
    for speed; a fast shutdown still checkpoints, so data survives stop()/start(). Invariant: after close() no server
    of this object runs and its directory is gone."""

    SUPERUSER = "postgres"

    def __init__(self):
        reason = self.available()
        if reason:
            raise RuntimeError(reason)
        self.bindir = _postgres_bindir()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="kcaas-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._initialised = False
        atexit.register(self.close)
        if self._as_postgres():
            os.chown(self.root, *_ids(self.SUPERUSER))

    @staticmethod
    def available() -> str | None:
        """None when a cluster can be made here, else the reason it cannot."""
        if _postgres_bindir() is None:
            return "needs PostgreSQL server binaries (/usr/lib/postgresql/*/bin)"
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(PrivatePostgres.SUPERUSER)
            except KeyError:
                return "running as root and there is no postgres user to run PostgreSQL as"
            if shutil.which("runuser") is None:
                return "running as root without runuser"
        return None

    @staticmethod
    def _as_postgres() -> bool:
        return os.geteuid() == 0

    def _run(self, *args: str, timeout: float = 60) -> None:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres():
            command = ["runuser", "-u", self.SUPERUSER, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}{self.server_log()}")

    def server_log(self) -> str:
        try:
            return "\n--- server log ---\n" + self.log.read_text()[-3000:]
        except OSError:
            return ""

    def start(self) -> None:
        """initdb on first use, then start and wait until it accepts connections."""
        if not self._initialised:
            self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.SUPERUSER, "-E", "UTF8", "--no-sync")
            self._initialised = True
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def stop(self) -> None:
        """Fast shutdown (open sessions are cut, a checkpoint is written); a no-op when not running."""
        if self._initialised and self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://{self.SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """CREATE DATABASE `name` (a plain identifier); returns its URL."""
        import psycopg

        if not name.replace("_", "").isalnum():
            raise ValueError(f"not a plain database name: {name!r}")
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        """Stop the server (immediate shutdown if a fast one fails) and remove its directory. Idempotent."""
        if self.root.exists():
            try:
                self.stop()
            except (RuntimeError, subprocess.TimeoutExpired):
                try:
                    self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
                except (RuntimeError, subprocess.TimeoutExpired):
                    pass  # nothing left to stop (a stale pid file): removing the directory is what remains
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _ids(user: str) -> tuple[int, int]:
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid
