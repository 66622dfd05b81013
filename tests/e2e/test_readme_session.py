"""The README's first session, run as written against a real `make up` (scripts/up.py on the embedded defaults and
make up's own node size), so it cannot rot: the marked shell block's lines, in order. `make up` is started with
KCAAS_URL naming a free port (it must listen there), the README's `export` line is replaced by the one make up's
banner prints (same shape), and the remaining lines run in one bash with `make demo` standing for the Makefile's
demo recipe. A demo pointed at a port where nothing listens fails naming KCAAS_URL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from tests.e2e.up_support import (
    REPO,
    SERVICE_ENV,
    assert_session_gone,
    kill_session,
    make_recipe,
    read_banner,
    start_script,
)
from tests.faults import free_port

MARKER = "<!-- readme-session:"
EXPORT = re.compile(r"^export KCAAS_URL=(\S+) KCAAS_API_KEY=(\S+)$")


def readme_session() -> list[str]:
    """The shell commands of the marked block: comments dropped, backslash continuations joined."""
    text = (REPO / "README.md").read_text()
    block = text.split(MARKER, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands, pending = [], ""
    for raw in block.splitlines():
        line = re.sub(r"\s+#.*$", "", raw).strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if pending + line:
            commands.append(pending + line)
        pending = ""
    return commands


def test_the_readme_first_session_works_on_make_up(tmp_path):
    commands = readme_session()
    assert commands[0] == "make up" and EXPORT.match(commands[1]), commands
    assert make_recipe("up") == f"{sys.executable} scripts/up.py"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV and not k.startswith("KCAAS_")}
    env.update(KCAAS_VAR_DIR=str(tmp_path / "var"), KCAAS_URL=f"http://127.0.0.1:{port}")
    up = start_script("up.py", env, subprocess.DEVNULL)
    try:
        banner = read_banner(up, "make up")
        printed = [line.strip() for line in banner.splitlines() if line.strip().startswith("export ")]
        assert len(printed) == 1 and EXPORT.match(printed[0]), banner
        assert EXPORT.match(printed[0]).group(1) == f"http://127.0.0.1:{port}"  # make up listens where KCAAS_URL says

        shell = "\n".join(
            [
                "set -euo pipefail",
                f'make() {{ [ "$1" = demo ] && {make_recipe("demo")}; }}',
                printed[0],
                *commands[2:],
            ]
        )
        session_env = {k: v for k, v in env.items() if k != "KCAAS_URL"}
        ran = subprocess.run(
            ["bash", "-c", shell], cwd=REPO, env=session_env, capture_output=True, text=True, timeout=600
        )
        assert ran.returncode == 0, (ran.stdout[-3000:], ran.stderr[-3000:])
        listing = [line for line in ran.stdout.splitlines() if re.search(r"\bchat\b", line)]
        assert listing and "ready" in listing[-1], ran.stdout
        assert re.search(r"hit rate\s+[\d.]+%", ran.stdout), ran.stdout[-3000:]

        nowhere = subprocess.run(
            [sys.executable, "scripts/demo.py"],
            cwd=REPO,
            env={**session_env, "KCAAS_URL": f"http://127.0.0.1:{free_port()}"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert nowhere.returncode != 0 and "KCAAS_URL" in nowhere.stderr, nowhere.stderr

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        kill_session(up)
    assert_session_gone(up)
