"""`make demo` as a user runs it: scripts/up.py on the embedded defaults in a fresh var/ directory, then
scripts/demo.py against it (the demo key and the dev CA from var/secrets): the tiny model's prompts share a system
prompt, so the demo reports a hit rate above zero; then Ctrl-C stops make up."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.faults import free_port

REPO = Path(__file__).resolve().parents[2]


def test_make_demo_reports_hits_against_make_up(tmp_path):
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "DATABASE_URL",
            "REDIS_URL",
            "CELERY_BROKER_URL",
            "DJANGO_SETTINGS_MODULE",
            "KCAAS_API_KEY",
            "KCAAS_CA_FILE",
            "KCAAS_URL",
        }
    }
    env.update(KCAAS_VAR_DIR=str(tmp_path / "var"), KCAAS_PORT=str(port), KCAAS_NODE_DEVICE_BYTES=str(64 << 20))
    up = subprocess.Popen(
        [sys.executable, "scripts/up.py"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        banner = ""
        deadline = time.monotonic() + 120
        while "Ctrl-C stops everything" not in banner:
            assert time.monotonic() < deadline and up.poll() is None, f"make up did not come up: {banner[-2000:]}"
            banner += up.stdout.readline()

        demo = subprocess.run(
            [sys.executable, "scripts/demo.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**env, "KCAAS_URL": f"http://127.0.0.1:{port}"},
            timeout=90,
        )
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        hit_rate = float(re.search(r"hit rate\s+([\d.]+)%", demo.stdout).group(1))
        assert hit_rate > 0, demo.stdout
        assert re.search(r"prefill tokens saved\s+[1-9]\d*", demo.stdout)
        assert "time saved" in demo.stdout and "same tokens as without the service: yes" in demo.stdout
        print(demo.stdout)

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
