"""Redis as bench.dataplane's peer, at its best: a private redis-server (nothing else on it, no persistence) on a Unix
socket, the same transport as the KCaaS UDS contenders, driven by redis-py with the hiredis parser."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time


class PrivateRedis:
    """redis-server on a Unix socket in a temporary directory; `client` is a redis-py client (hiredis when installed:
    `hiredis` says which). Raises RuntimeError with the reason when there is no redis-server or it does not start."""

    def __init__(self, startup_seconds: float = 10.0):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("no redis-server on PATH")
        import redis
        from redis.utils import HIREDIS_AVAILABLE

        self.directory = tempfile.mkdtemp(prefix="kcaas-bench-redis-")
        self.socket_path = os.path.join(self.directory, "redis.sock")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                "0",
                "--unixsocket",
                self.socket_path,
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.directory,
                "--proto-max-bulk-len",
                "1gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.hiredis = bool(HIREDIS_AVAILABLE)
        self.client = redis.Redis(unix_socket_path=self.socket_path, socket_timeout=60)
        deadline = time.monotonic() + startup_seconds
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)
        self.version = self.client.info("server").get("redis_version", "?")

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing what may already be gone
            pass
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.directory, ignore_errors=True)
