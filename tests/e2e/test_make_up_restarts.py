"""`make up` keeps the control plane running: scripts/up.py on the embedded defaults (SQLite, file-system broker, a
CPU node agent) in a fresh var/ directory. The Celery worker is SIGKILLed (as the OOM killer would): up.py reports
it and starts it again, and the printed key still attaches a cache that becomes ready (the node's answer is handled
by the new worker) and detaches it. Beat is SIGKILLed too and comes back under a new pid. Ctrl-C then stops every
child, the restarted ones included: no process of up.py's session is left.

up.py's Supervisor on its own, with real child processes that exit at once and an explicit clock: the backoff (1 s
doubling to 30 s, reset after a start that lived 60 s), the crash-loop guard (a sixth restart within 60 s stops
everything) and the agents' rule (a dead agent stops everything; with survive_agent_loss it is only reported)."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kcaas
from tests.e2e.test_make_up import SPEC
from tests.e2e.up_support import (
    REPO,
    assert_session_gone,
    keep_draining,
    kill_session,
    read_banner,
    reported_pids,
    start_up,
)
from tests.faults import free_port
from tests.waiting import eventually


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def restarted_pid(stderr_file: Path, name: str, after: int) -> int | None:
    """The pid of the newest restart of `name` that up.py reported on stderr, once it is not `after`."""
    found = re.findall(rf"^{name} restarted \(pid (\d+)\)$", stderr_file.read_text(), re.MULTILINE)
    return int(found[-1]) if found and int(found[-1]) != after else None


def kill_and_await_restart(up: subprocess.Popen, stderr_file: Path, name: str, pid: int) -> int:
    """SIGKILLs the child, waits until up.py reports it (`<name> exited (-9): restarting ...`) and has started it
    again; returns the new pid, alive. up.py itself keeps running."""
    os.kill(pid, signal.SIGKILL)
    assert eventually(lambda: restarted_pid(stderr_file, name, pid) or up.poll() is not None, timeout=60), (
        stderr_file.read_text()[-3000:]
    )
    assert up.poll() is None, f"make up stopped when {name} died: {stderr_file.read_text()[-3000:]}"
    assert f"{name} exited (-9): restarting" in stderr_file.read_text()
    new_pid = restarted_pid(stderr_file, name, pid)
    assert new_pid != pid and alive(new_pid) and not alive(pid)
    return new_pid


def test_make_up_restarts_a_killed_worker_and_beat_and_still_stops_on_ctrl_c(tmp_path):
    port = free_port()
    stderr_file = tmp_path / "up.stderr"
    with open(stderr_file, "w") as stderr:
        up = start_up(tmp_path, port, stderr)
    up.stdout_lines = []
    started: list[int] = []
    try:
        banner = read_banner(up, "make up", stderr_file)
        keep_draining(up, up.stdout_lines)
        pids = reported_pids(banner, agents=1)
        started.extend(pids.values())
        api_key = re.search(r"demo API key\s+(kc_live_\S+)", banner).group(1)

        started.append(kill_and_await_restart(up, stderr_file, "worker", pids["worker"]))
        with kcaas.Client(f"http://127.0.0.1:{port}", api_key) as client:
            cache = client.attach("after-restart", SPEC, {"device": 1 << 20}, timeout=60)
            assert cache.state == "ready" and cache.endpoint == f"127.0.0.1:{port + 1}"
            assert client.detach(cache.id, wait=True, timeout=60).state == "detached"

        started.append(kill_and_await_restart(up, stderr_file, "beat", pids["beat"]))
        assert alive(pids["web"]) and alive(pids["agent-1"])

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert eventually(lambda: "stopped\n" in "".join(up.stdout_lines), timeout=10)
    finally:
        kill_session(up)
    assert [pid for pid in started if alive(pid)] == []  # the restarted children too
    assert_session_gone(up)  # no child of make up outlives it


def load_up():
    """scripts/up.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("kcaas_up_script_restarts", REPO / "scripts" / "up.py")
    up = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(up)
    return up


def exiting(status: int) -> list[str]:
    return [sys.executable, "-c", f"raise SystemExit({status})"]


def die_and_step(supervisor, child, now: float) -> None:
    """Waits until the child's current process has exited (it exits at once), then one supervision step at `now`."""
    assert eventually(lambda: child.proc.poll() is not None, timeout=30)
    supervisor.step(now)


def test_a_crash_looping_child_is_restarted_with_backoff_then_stops_everything(capsys):
    up = load_up()
    child = up.Child("worker", exiting(3), dict(os.environ))
    supervisor = up.Supervisor([child], survive_agent_loss=False)
    now, delays, pids = 1000.0, [], []
    child.start(now)
    for _ in range(up.CRASH_RESTARTS):
        pids.append(child.proc.pid)
        die_and_step(supervisor, child, now)
        delays.append(child.restart_at - now)
        supervisor.step(child.restart_at - 0.01)
        assert child.proc.pid == pids[-1]  # not before its delay
        now = child.restart_at
        supervisor.step(now)
        assert child.restart_at is None and child.proc.pid not in pids  # started again
    assert delays == [1, 2, 4, 8, 16]
    assert eventually(lambda: child.proc.poll() is not None, timeout=30)
    with pytest.raises(up.GiveUp) as stop:
        supervisor.step(now)
    assert stop.value.status == 1
    assert "worker exited (3) after 5 restarts within 60 s: giving up, stopping the rest" == str(stop.value)
    err = capsys.readouterr().err
    assert "worker exited (3): restarting in 1 s\n" in err and "worker exited (3): restarting in 16 s\n" in err
    assert err.count("worker restarted (pid ") == 5


def test_backoff_is_capped_at_30_s_and_resets_after_a_start_that_lived_a_minute():
    up = load_up()
    child = up.Child("beat", exiting(1), dict(os.environ))
    supervisor = up.Supervisor([child], survive_agent_loss=False)
    now, delays = 0.0, []
    child.start(now)
    for _ in range(8):  # each start lives 25 s: never more than 5 restarts within 60 s
        now += 25
        die_and_step(supervisor, child, now)
        delays.append(child.restart_at - now)
        now = child.restart_at
        supervisor.step(now)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    now += 60
    die_and_step(supervisor, child, now)
    assert child.restart_at - now == 1


def test_a_dead_agent_stops_everything_unless_agent_loss_is_survived(capsys):
    up = load_up()
    agent = up.Child("agent-2", exiting(0), dict(os.environ), agent=True)
    agent.start(0.0)
    with pytest.raises(up.GiveUp) as stop:
        die_and_step(up.Supervisor([agent], survive_agent_loss=False), agent, 1.0)
    assert str(stop.value) == "agent-2 stopped: stopping the rest" and stop.value.status == 0

    agent.start(0.0)
    surviving = up.Supervisor([agent], survive_agent_loss=True)
    pid = agent.proc.pid
    die_and_step(surviving, agent, 1.0)
    surviving.step(100.0)
    assert agent.proc.pid == pid and agent.restart_at is None  # reported, never restarted
    err = capsys.readouterr().err
    assert err.count("agent-2 exited (0): the control plane will mark its node lost") == 1
