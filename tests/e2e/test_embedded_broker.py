"""The embedded default's Celery broker with a real worker process: `celery -A controlplane worker -Q control`
on the settings' defaults (SQLite and the file-system broker under a fresh KCAAS_VAR_DIR, no DATABASE_URL,
REDIS_URL or CELERY_BROKER_URL), as `make up` runs it. An empty and a truncated message file dropped into its
queue folder do not stop it: it keeps running tasks, and the files end in the quarantine folder."""

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.faults import stop_process
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
SERVICE_ENV = {
    "DATABASE_URL",
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "CELERY_BROKER_TRANSPORT_OPTIONS",
    "DJANGO_SETTINGS_MODULE",
}
FIRST = "0" * 20  # sorts before every message's stamp: the worker meets the stray files first
SEND = "from core.celery import app; app.send_task('caches.sweep_leases')"


def embedded_env(var_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV}
    env.update(
        KCAAS_VAR_DIR=str(var_dir),
        PYTHONPATH=f"{REPO / 'platform'}:{REPO}",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
    )
    return env


def manage(env: dict, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_worker_survives_stray_files_in_its_queue_folder_and_still_runs_tasks(tmp_path):
    var, log_path = tmp_path / "var", tmp_path / "worker.log"
    env = embedded_env(var)
    queue_folder = var / "celery" / "queue"
    for folder in ("queue", "processed", "control"):  # as scripts/up.py makes them
        (var / "celery" / folder).mkdir(parents=True)
    manage(env, "migrate", "--noinput")
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-Q",
                "control",
                "--pool",
                "solo",
                "--loglevel",
                "info",
                "--hostname",
                "control@%h",
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert eventually(lambda: " ready." in log_path.read_text() or worker.poll() is not None, 60)
        assert worker.poll() is None, log_path.read_text()[-3000:]

        old = queue_folder / f"{FIRST}_a-empty-old.control.msg"
        old.write_bytes(b"")
        an_hour_ago = time.time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))
        (queue_folder / f"{FIRST}_b-empty-young.control.msg").write_bytes(b"")
        (queue_folder / f"{FIRST}_c-truncated.control.msg").write_bytes(b'{"body": "eyJ0YXNr", "content-enc')
        manage(env, "shell", "-c", SEND)

        def ran() -> bool:
            text = log_path.read_text()
            return worker.poll() is not None or ("caches.sweep_leases[" in text and "succeeded" in text)

        assert eventually(ran, 60) and worker.poll() is None, log_path.read_text()[-3000:]
        quarantine = var / "celery" / "quarantine"
        assert eventually(lambda: quarantine.is_dir() and len(os.listdir(quarantine)) == 3, 60)
        assert worker.poll() is None, log_path.read_text()[-3000:]
        assert not list(queue_folder.glob("*.msg"))
        manage(env, "shell", "-c", SEND)  # and it keeps serving
        assert eventually(lambda: log_path.read_text().count("succeeded") >= 2 or worker.poll() is not None, 60)
        assert worker.poll() is None and "Unrecoverable error" not in log_path.read_text()
    finally:
        stop_process(worker, timeout=30, group=True)
