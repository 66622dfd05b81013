"""The `billing.rollup` beat task on the embedded default's SQLite, for real: manage.py processes with DATABASE_URL
unset and KCAAS_VAR_DIR a fresh directory (the suite's own database is PostgreSQL only, so SQLite runs apart).

tests/billing/rollup_scenario.py records usage through billing.services.usage_report_record on a cache attached
through caches.services; the task body (billing.tasks.rollup) then writes the ledger rows, counting from a
baseline sample before the open hours, and rollups racing each other and new reports all succeed (SQLite's
immediate write lock serialises them). The same scenario on PostgreSQL gives the same ledger."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.billing import rollup_scenario

REPO = Path(__file__).resolve().parents[2]
SERVICE_ENV = {
    "DATABASE_URL",
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "CELERY_BROKER_TRANSPORT_OPTIONS",
    "DJANGO_SETTINGS_MODULE",
}


def sqlite_env(var_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV}
    env.update(KCAAS_VAR_DIR=str(var_dir), KCAAS_USAGE_GRACE_SECONDS="600", PYTHONPATH=f"{REPO / 'platform'}:{REPO}")
    return env


def manage(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def scenario(env: dict, *step: str) -> subprocess.Popen:
    arguments = ", ".join(repr(s) for s in step)
    return manage(env, "shell", "-c", f"from tests.billing.rollup_scenario import main; main({arguments})")


def finished(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-4000:]
    return out


def result(process: subprocess.Popen):
    """The JSON line a scenario step printed last (it must have exited 0)."""
    return json.loads(finished(process).strip().splitlines()[-1])


def migrated(tmp_path) -> dict:
    env = sqlite_env(tmp_path / "var")
    finished(manage(env, "migrate", "--noinput"))
    return env


def test_rollup_writes_the_ledger_on_sqlite(tmp_path):
    env = migrated(tmp_path)
    result(scenario(env, "setup"))
    ledger = result(scenario(env, "rollups", "2"))
    assert ledger["rows"] >= 1 and ledger["written"] == [ledger["rows"]] * 2  # a rerun writes the same rows
    assert ledger["totals"] == rollup_scenario.EXPECTED_TOTALS


def test_rollups_racing_each_other_and_reports_all_succeed_on_sqlite(tmp_path):
    env = migrated(tmp_path)
    ids = result(scenario(env, "setup"))
    racers = [scenario(env, "rollups", "10") for _ in range(2)] + [scenario(env, "more_reports", json.dumps(ids))]
    for racer in racers:
        result(racer)  # none failed ("database is locked" included)
    totals = result(scenario(env, "rollups", "1"))["totals"]
    assert totals["tokens"] == 30 and totals["device"] > 0  # the later empty samples cut the last one's hold short


def test_the_same_scenario_on_postgresql(db, settings):
    settings.KCAAS_USAGE_GRACE_SECONDS = 600
    rollup_scenario.setup()
    ledger = rollup_scenario.rollups(2)
    assert ledger["rows"] >= 1 and ledger["written"] == [ledger["rows"]] * 2
    assert ledger["totals"] == rollup_scenario.EXPECTED_TOTALS
