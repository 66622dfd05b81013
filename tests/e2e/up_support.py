"""scripts/up.py (`make up`) and scripts/cluster.py (`make cluster`, up.py with two node agents) as the e2e tests run
them: started in a session of their own (so the whole process tree can be killed with them), their stdout read up
to the end of the banner (then, where asked, kept drained by a thread), the pids the banner reports, and the check
that no process of that session outlives them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BANNER_END = "Ctrl-C stops everything"
# What the README's `export` line leaves in a developer's shell: KCAAS_URL would override KCAAS_PORT in up.py.
SHELL_TARGET_ENV = {"KCAAS_URL", "KCAAS_API_KEY"}
SERVICE_ENV = {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"}  # unset: embedded defaults


def start_script(script: str, env: dict, stderr, *args: str) -> subprocess.Popen:
    """`python scripts/<script> *args` from the repository root, in its own session, its stdout a text pipe."""
    return subprocess.Popen(
        [sys.executable, f"scripts/{script}", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def start_up(tmp_path: Path, port: int, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """scripts/up.py on the embedded defaults (SQLite, the file-system broker: no service variable), its state in
    tmp_path/var, the API on `port`, a 64 MiB device pool."""
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV | SHELL_TARGET_ENV}
    env.update(KCAAS_VAR_DIR=str(tmp_path / "var"), KCAAS_PORT=str(port), KCAAS_NODE_DEVICE_BYTES=str(64 << 20))
    return start_script("up.py", env, stderr)


def read_banner(process: subprocess.Popen, what: str, stderr_file: Path | None = None) -> str:
    """The process's stdout up to the end of its banner; fails the test (`what` did not come up, with the end of
    `stderr_file` when given) if the process exits or 120 s pass first."""
    banner = ""
    deadline = time.monotonic() + 120
    while BANNER_END not in banner:
        if time.monotonic() > deadline or process.poll() is not None:
            stderr = f" {stderr_file.read_text()[-3000:]}" if stderr_file is not None else ""
            pytest.fail(f"{what} did not come up: {banner[-2000:]}{stderr}")
        banner += process.stdout.readline()
    return banner


def keep_draining(process: subprocess.Popen, lines: list[str]) -> None:
    """A thread appends the rest of the process's stdout to `lines` (a chatty child never blocks on a full pipe)."""
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()


def reported_pids(banner: str, agents: int) -> dict[str, int]:
    """The banner's `processes` line (name -> pid): web server, worker, beat, KV indexer and `agents` node agents."""
    line = banner.split("processes", 1)[1].splitlines()[0]  # that line only: later ones hold `VAR=value` exports
    pids = {name: int(pid) for name, pid in re.findall(r"(\S+)=(\d+)", line)}
    assert set(pids) == {"web", "worker", "beat", "indexer", *(f"agent-{n}" for n in range(1, agents + 1))}
    return pids


def assert_all_gone(pids: dict[str, int]) -> None:
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (and reaped: a zombie would still answer)


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole session if the process still runs, and reap it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def assert_session_gone(process: subprocess.Popen) -> None:
    leftovers = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert leftovers == []  # no child of the script outlives it


def make_recipe(target: str) -> str:
    """The command the Makefile's `target` runs after `install` (which the test's .venv already satisfies)."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{target}: install\n\t(.+)$", makefile, re.MULTILINE).group(1)
    return recipe.replace("$(PY)", sys.executable)
