"""The platform side of bench.vllm_connector: scripts/up.py (`make up`'s embedded defaults: SQLite, the file broker,
one CPU node agent, TLS 1.3 data plane) in a temporary KCAAS_VAR_DIR on a free port block, in its own session
(Platform), the cache the KCaaS engines attach to (attach_cache), and the wait for the connector's file
(wait_for_connector). Runs in the main venv. Not a benchmark of its own (`make bench` skips bench/_*.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BANNER_END = "Ctrl-C stops everything"
SERVICE_ENV = {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"}  # unset: embedded defaults
CONNECTOR_FILE = REPO / "kcaas" / "connectors" / "vllm.py"
CACHE_NAME = "bench-vllm"


def free_port_block(span: int = 102) -> int:
    """A port p with p, p+1 (the node's data plane) and p+101 (its metrics) free (up.py's defaults)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span > 65535:
            continue
        try:
            for p in (port, port + 1, port + 101):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port block")


class Platform:
    """scripts/up.py (`make up`'s embedded defaults) in a temporary KCAAS_VAR_DIR on a free port, in its own session."""

    def __init__(self, workdir: str, device_bytes: int):
        self.var = Path(workdir) / "var"
        self.port = free_port_block()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV}
        env.update(KCAAS_VAR_DIR=str(self.var), KCAAS_PORT=str(self.port), KCAAS_NODE_DEVICE_BYTES=str(device_bytes))
        self.log_path = Path(workdir) / "up.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "scripts/up.py"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        banner = ""
        deadline = time.monotonic() + 180
        while BANNER_END not in banner:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"the platform did not come up: {banner[-1500:]} {tail}")
            banner += self.proc.stdout.readline()
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # keep draining
        self.api_key = (self.var / "secrets" / "demo-api-key").read_text().strip()
        self.ca_file = str(self.var / "secrets" / "dev-ca.pem")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of its session still left
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def wait_for_connector(log, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not CONNECTOR_FILE.exists():
        if time.monotonic() > deadline:
            return False
        log(f"waiting for {CONNECTOR_FILE.relative_to(REPO)} ...")
        time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
    return True


def attach_cache(platform: Platform, spec: dict, device_bytes: int, name: str = CACHE_NAME):
    """A kcaas.Client on the platform (the demo tenant's key) and a freshly attached cache `name` of `spec`."""
    sys.path.insert(0, str(REPO))
    import kcaas

    client = kcaas.Client(platform.url, platform.api_key)
    return client, client.attach(name, spec, {"device": device_bytes}, timeout=120)
