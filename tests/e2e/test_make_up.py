"""`make up` as a user runs it: scripts/up.py on the embedded defaults (SQLite, file-system broker, a CPU node agent,
no external service), in a fresh var/ directory. The printed key attaches a cache that becomes ready through the
node agent; Ctrl-C stops every process."""

import re
import signal
import urllib.request
from pathlib import Path

import kcaas
from tests.e2e.up_support import assert_session_gone, kill_session, read_banner, start_up
from tests.faults import free_port
from tests.waiting import eventually

SPEC = {
    "model_fingerprint": "tiny@1",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "block_size": 16,
    "kv_dtype": "float16",
    "storage_dtype": "float16",
}


# What make up printed before its banner on a fresh machine, and must not print again: whitenoise's missing static
# folder, Celery's startup banners and root warning, kombu's "No hostname was supplied" for the file broker.
NOISE = re.compile(r"Warning|WARNING|No directory at|No hostname was supplied|celery beat v|-------------- \[queues\]")


def test_make_up_serves_a_cache_end_to_end_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    stderr_path = tmp_path / "up.stderr"
    with open(stderr_path, "w") as stderr:
        up = start_up(tmp_path, port, stderr=stderr)
    try:
        banner = read_banner(up, "make up", stderr_path)
        before_banner = banner[: banner.index("KCaaS is up.")] + stderr_path.read_text()
        noise = [line for line in before_banner.splitlines() if NOISE.search(line)]
        assert not noise, "make up printed warnings or banners before its own:\n" + "\n".join(noise)
        api_key = re.search(r"demo API key\s+(kc_live_\S+)", banner).group(1)
        assert re.search(r"admin login\s+admin / \S+", banner)
        console_password = re.search(r"/console/\s+login console / (\S+)", banner).group(1)
        ca_file = Path(re.search(r"dev CA: ([^)\s]+)\)", banner).group(1))
        assert ca_file.is_file() and b"BEGIN CERTIFICATE" in ca_file.read_bytes()
        secrets = tmp_path / "var" / "secrets"
        for key_file in ("node-tls.key", "dev-ca.key", "demo-api-key", "console-password"):
            assert (secrets / key_file).stat().st_mode & 0o777 == 0o600
        assert (secrets / "demo-api-key").read_text().strip() == api_key

        assert (secrets / "console-password").read_text().strip() == console_password
        _console_is_served(f"http://127.0.0.1:{port}")

        client = kcaas.Client(f"http://127.0.0.1:{port}", api_key)
        assert client.whoami().kind == "tenant_key"
        cache = client.attach("demo", SPEC, {"device": 1 << 20}, timeout=60)
        assert cache.state == "ready" and cache.endpoint == f"127.0.0.1:{port + 1}"
        client.close()
        _metrics_cover_every_control_plane_process(f"http://127.0.0.1:{port}")

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert "stopped" in up.stdout.read()
    finally:
        kill_session(up)
    assert_session_gone(up)  # no child of make up outlives it


def _metrics_cover_every_control_plane_process(base: str) -> None:
    """One /metrics answer for gunicorn's workers and the Celery worker (make up's shared PROMETHEUS_MULTIPROC_DIR):
    the attach counted by the web process, the node's provisioning answer by the control worker."""

    def scrape() -> str:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as answer:
            return answer.read().decode()

    worker_line = re.compile(r'^kcaas_celery_tasks_total\{[^}]*task="caches.provision_result"[^}]*\} [1-9]', re.M)
    assert eventually(lambda: worker_line.search(scrape()), timeout=30), "the control worker's tasks are not shown"
    assert re.search(r'^kcaas_cache_attaches_total\{outcome="ok"\} 1\.0$', scrape(), re.M)


def _console_is_served(base: str) -> None:
    """The sign-in page and its static files (htmx, the stylesheet) come from the app server itself: no CDN, no
    collectstatic step."""
    with urllib.request.urlopen(base + "/console/login", timeout=10) as answer:
        page = answer.read().decode()
        assert answer.status == 200 and "Sign in" in page
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', page):
        with urllib.request.urlopen(base + asset, timeout=10) as answer:
            assert answer.status == 200 and answer.read()
    assert "/static/django_htmx/" in page and "/static/console/console.css" in page
