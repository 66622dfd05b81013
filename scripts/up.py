"""`make up`: the whole platform on this machine, on embedded defaults (SQLite, a file-system Celery broker, one
node agent on the CPU), or on DATABASE_URL / REDIS_URL / CELERY_BROKER_URL when they are set.

Steps: migrate; a staff login, a demo tenant key (also written to var/secrets/demo-api-key, 0600, for `make demo`),
the local node's credential, and a dev CA with a server certificate for 127.0.0.1/localhost (var/secrets/dev-ca.pem
and node-tls.pem/.key, made once and reused; keys 0600) for the agent's TLS 1.3 data plane, all kept under var/
across runs; then the web server (gunicorn on 127.0.0.1), the control queue's Celery worker, Celery beat and the node
agent, each a child process. Prints the URLs, the login, the key and the dev CA's path (engines trust it) once the
server answers. Ctrl-C (or SIGTERM) stops every child (SIGTERM, then SIGKILL after a grace period); if any child
dies, the rest are stopped too.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
GRACE_SECONDS = 15


def base_env() -> dict:
    var_dir = Path(os.environ.get("KCAAS_VAR_DIR", REPO / "var"))
    env = {**os.environ, "KCAAS_VAR_DIR": str(var_dir), "PYTHONPATH": f"{REPO / 'platform'}:{REPO}"}
    env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    if not env.get("CELERY_BROKER_URL") and not env.get("REDIS_URL"):
        queue, processed, control = (var_dir / "celery" / name for name in ("queue", "processed", "control"))
        for folder in (queue, processed, control):
            folder.mkdir(parents=True, exist_ok=True)
        env["CELERY_BROKER_URL"] = "filesystem://"
        # the node agent's own Celery app must use the same folders as the control plane's (settings.py)
        env["CELERY_BROKER_TRANSPORT_OPTIONS"] = json.dumps(
            {"data_folder_in": str(queue), "data_folder_out": str(queue), "processed_folder": str(processed),
             "control_folder": str(control), "store_processed": False}
        )
    elif not env.get("CELERY_BROKER_URL"):
        env["CELERY_BROKER_URL"] = env["REDIS_URL"]
    return env


def write_secret(path: Path, data: bytes) -> None:
    """Writes a file readable only by its owner (0600 from the start, not chmod-ed after the fact)."""
    from gpu_node.dev_pki import write_private

    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, data)


def dev_tls(secrets_dir: Path) -> dict[str, Path]:
    """A dev CA and a server certificate for 127.0.0.1 / localhost under secrets_dir, made once and reused on later
    runs (engines trust dev-ca.pem). Made again only when a file is missing or the server certificate expires soon."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from gpu_node.dev_pki import new_ca, new_server_cert, pem_cert, pem_key

    paths = {"ca": secrets_dir / "dev-ca.pem", "ca_key": secrets_dir / "dev-ca.key",
             "cert": secrets_dir / "node-tls.pem", "key": secrets_dir / "node-tls.key"}
    now = dt.datetime.now(dt.timezone.utc)
    if all(path.exists() for path in paths.values()):
        cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
        if cert.not_valid_after_utc > now + dt.timedelta(days=1):
            return paths
    if paths["ca"].exists() and paths["ca_key"].exists():
        ca_key = serialization.load_pem_private_key(paths["ca_key"].read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    else:
        ca_key, ca_cert = new_ca("KCaaS make up dev CA", valid_for=dt.timedelta(days=3650))
        write_secret(paths["ca_key"], pem_key(ca_key))
        paths["ca"].write_bytes(pem_cert(ca_cert))
    key, cert = new_server_cert(ca_key, ca_cert, "KCaaS make up node", valid_for=dt.timedelta(days=365))
    write_secret(paths["key"], pem_key(key))
    paths["cert"].write_bytes(pem_cert(cert))
    return paths


def manage(env: dict, *args: str) -> str:
    done = subprocess.run([PYTHON, str(REPO / "manage.py"), *args], env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip()


def children(env: dict, host: str, port: int) -> dict[str, list[str]]:
    var_dir = Path(env["KCAAS_VAR_DIR"])
    return {
        "web": [PYTHON, "-m", "gunicorn", "controlplane.wsgi:application", "--bind", f"{host}:{port}",
                "--workers", "2", "--worker-class", "gthread", "--threads", "4", "--log-level", "warning"],
        "worker": [PYTHON, "-m", "celery", "-A", "controlplane", "worker", "-Q", "control", "--pool", "solo",
                   "--loglevel", "warning", "--hostname", "control@%h"],
        "beat": [PYTHON, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "warning",
                 "--schedule", str(var_dir / "celerybeat-schedule")],
        "node": [PYTHON, "-m", "gpu_node.agent"],
    }


def wait_until_up(url: str, processes: dict, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [name for name, proc in processes.items() if proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited during start-up")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the web server did not answer within a minute")


def wait_for_node(node: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the agent says it registered (its first stdout line); then its output is passed through."""
    deadline = time.monotonic() + timeout
    line = ""
    while "ready" not in line:
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the node agent did not register")
        line = node.stdout.readline()
    threading.Thread(target=lambda: [sys.stdout.write(out) for out in node.stdout], daemon=True).start()


def stop_all(processes: dict) -> None:
    for proc in processes.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for proc in processes.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    host, port = os.environ.get("KCAAS_HOST", "127.0.0.1"), int(os.environ.get("KCAAS_PORT", "8000"))
    url = f"http://{host}:{port}"
    env = base_env()
    secrets_dir = Path(env["KCAAS_VAR_DIR"]) / "secrets"
    manage(env, "migrate", "--noinput")
    password = manage(env, "kcaas_local_admin", "admin", "--password-file", str(secrets_dir / "admin-password"))
    api_key = manage(env, "kcaas_create_tenant", "demo", "--reuse", "--key-name", "make up")
    credential = manage(env, "kcaas_local_node", "local-cpu", "--credential-file", str(secrets_dir / "node-credential"))
    write_secret(secrets_dir / "demo-api-key", api_key.encode() + b"\n")  # for `make demo`
    tls = dev_tls(secrets_dir)
    node_env = {
        **env,
        "KCAAS_CONTROL_URL": url,
        "KCAAS_NODE_CREDENTIAL": credential,
        "KCAAS_NODE_ENDPOINT": os.environ.get("KCAAS_NODE_ENDPOINT", f"{host}:{port + 1}"),
        "KCAAS_NODE_DEVICE_BYTES": os.environ.get("KCAAS_NODE_DEVICE_BYTES", str(1 << 30)),
        "KCAAS_NODE_TORCH_DEVICE": os.environ.get("KCAAS_NODE_TORCH_DEVICE", "cpu"),
        "KCAAS_NODE_TLS_CERT": os.environ.get("KCAAS_NODE_TLS_CERT") or str(tls["cert"]),
        "KCAAS_NODE_TLS_KEY": os.environ.get("KCAAS_NODE_TLS_KEY") or str(tls["key"]),
    }
    node_env.pop("DJANGO_SETTINGS_MODULE", None)  # the node agent never loads Django

    stop_requested = False

    def request_stop(*_):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name, command in children(env, host, port).items():
            if name == "node":  # it registers over HTTP: the web server must answer first
                wait_until_up(url, processes)
            is_node = name == "node"
            processes[name] = subprocess.Popen(
                command, env=node_env if is_node else env, cwd=REPO, stdout=subprocess.PIPE if is_node else None,
                text=True,
            )
        wait_for_node(processes["node"])
        print(
            f"\nKCaaS is up.\n"
            f"  API           {url}/api/v1/   (OpenAPI: {url}/api/schema/, docs: {url}/api/docs/)\n"
            f"  console       {url}/api/docs/   (the web console arrives with issue 7)\n"
            f"  admin login   admin / {password}   (staff: HTTP basic auth on /api/v1/admin/...)\n"
            f"  demo API key  {api_key}\n"
            f"  data plane    TLS 1.3 on {node_env['KCAAS_NODE_ENDPOINT']}   (dev CA: {tls['ca']})\n"
            f"  try: curl -H 'Authorization: Bearer {api_key}' {url}/api/v1/whoami\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )
        while not stop_requested and all(proc.poll() is None for proc in processes.values()):
            time.sleep(0.2)
        dead = [name for name, proc in processes.items() if proc.poll() is not None]
        if dead and not stop_requested:
            print(f"{', '.join(dead)} stopped: stopping the rest", file=sys.stderr, flush=True)
    except RuntimeError as error:
        print(f"make up: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_all(processes)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
