"""`make up`: the whole platform on this machine, on embedded defaults (SQLite, a file-system Celery broker, one
node agent on the CPU), or on DATABASE_URL / REDIS_URL / CELERY_BROKER_URL when they are set. `make cluster`
(scripts/cluster.py) is this script with `--agents 2 --require-services`: the docker-compose topology as local
processes.

Steps: migrate; a staff login, a demo tenant key (also written to var/secrets/demo-api-key, 0600, for `make demo`),
one credential per node agent, and a dev CA with one server certificate per agent for 127.0.0.1/localhost (plus the
names in KCAAS_DEV_TLS_HOSTS) (var/secrets/dev-ca.pem, node-tls.pem/.key, node-2-tls.pem/.key, ...; made once and
reused; keys 0600) for the agents' TLS 1.3 data planes, all kept under var/ across runs; then the web server
(gunicorn on 127.0.0.1), the control queue's Celery worker, Celery beat, the KV-event indexer and the node agents,
each a child process.
Prints the URLs, the login, the key, every node's endpoints, the dev CA's path (engines trust it) and the children's
pids once every agent has registered. Ctrl-C (or SIGTERM) stops every child, restarted ones included (SIGTERM, then
SIGKILL after a grace period).

Once up, a dead child is handled by its kind (class Supervisor):
- web (gunicorn), worker, beat, indexer: reported on stderr (`worker exited (-9): restarting in 1 s`, then
  `worker restarted (pid N)`) and started again with the same command and environment, after a backoff of 1 s
  doubling to 30 s (back to 1 s once a start has lived 60 s). A child that would be restarted a sixth time within
  60 s is crash-looping: everything is stopped, with a message saying so, and up.py exits with status 1.
- a node agent: everything is stopped (`agent-2 stopped: stopping the rest`, status 0), as a lost node is not
  something to paper over; with --survive-agent-loss its death is only reported and it stays dead: the control
  plane marks its node lost, as it would a crashed host. Agents are never restarted.
A child that dies during start-up (before the banner) stops everything: nothing is restarted then.

    scripts/up.py [--agents N] [--require-services] [--survive-agent-loss] [--bootstrap-only]

Files: up.py runs with umask 077 and its children inherit it, so everything made under var/ (KCAAS_VAR_DIR: the
SQLite database with TOTP devices and sessions, the file broker's messages, the dev PKI, the secrets, the SSD tiers)
is 0600 in 0700 directories; `secure_var_dir` brings a var/ left by an older run to the same modes at start.

Address: the API listens on KCAAS_URL's host and port when KCAAS_URL is set (http://HOST:PORT: the variable `make
demo`, `kcaas` and the SDK read, so one export points all of them at the same place), else on KCAAS_HOST /
KCAAS_PORT (default 127.0.0.1:8000); the banner ends with the `export KCAAS_URL=... KCAAS_API_KEY=...` line to paste
into another shell, and the operator's (`operator shell: export KCAAS_URL=... KCAAS_ADMIN_USER=admin
KCAAS_ADMIN_PASSWORD=...`, for `kcaas admin ...`). Each agent's data plane is on the next port up (8001, 8002, ...).

--agents defaults to KCAAS_AGENTS, else 1. --bootstrap-only does the first steps (migrate, login, key, node
credentials, TLS files; node files under KCAAS_NODE_SECRETS_DIR when set), prints them and exits: the one-shot
`bootstrap` service of docker-compose.yml.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # devtools.dev_pki, when run as a script
PYTHON = sys.executable
GRACE_SECONDS = 15
RESTART_DELAY, RESTART_MAX_DELAY = 1.0, 30.0  # a dead control-plane child's backoff: 1 s doubling to 30 s
CRASH_RESTARTS, CRASH_WINDOW = 5, 60.0  # a sixth restart of one child within 60 s: a crash loop, stop everything
DEFAULT_TLS_HOSTS = ("localhost", "127.0.0.1")
PRIVATE_UMASK = 0o077  # files 0600, directories 0700: var/ holds the database, broker messages, keys and secrets


def base_env() -> dict:
    """The children's environment. The broker: CELERY_BROKER_URL, else REDIS_URL, else the embedded one,
    `kcaasfs://` (kcaas.node_protocol.broker: kombu's file-system transport hardened; `filesystem://` is read as it). A
    file broker's folders (var/celery/...) are made here and handed to the node agents in
    CELERY_BROKER_TRANSPORT_OPTIONS: the same folders the control plane's settings.py derives from KCAAS_VAR_DIR."""
    from kcaas.node_protocol import broker as fs_broker

    var_dir = Path(os.environ.get("KCAAS_VAR_DIR", REPO / "var"))
    env = {**os.environ, "KCAAS_VAR_DIR": str(var_dir), "PYTHONPATH": f"{REPO / 'platform'}:{REPO}"}
    env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    if os.geteuid() == 0:
        # A developer's container often runs as root: Celery then warns, in every worker, that root is "absolutely not
        # recommended". make up is a local development platform; a deployment runs as its own user (the image: uid
        # 10001), where the warning would still show.
        env["PYTHONWARNINGS"] = ",".join(
            filter(None, [env.get("PYTHONWARNINGS"), "ignore:You're running the worker with superuser privileges"])
        )
    if not env.get("PROMETHEUS_MULTIPROC_DIR"):
        # gunicorn's workers, the control worker and beat write their metrics here; /metrics answers for all of them
        # (docs/observability.md). Emptied at each start: a run's counters begin at zero. Node agents drop it.
        metrics_dir = var_dir / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(mode=0o700, parents=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    env["CELERY_BROKER_URL"] = fs_broker.broker_url(
        env.get("CELERY_BROKER_URL") or env.get("REDIS_URL") or fs_broker.URL
    )
    if fs_broker.is_file_broker(env["CELERY_BROKER_URL"]):
        options = fs_broker.folder_options(var_dir / "celery")
        for folder in ("data_folder_in", "processed_folder", "control_folder", "quarantine_folder"):
            Path(options[folder]).mkdir(mode=0o700, parents=True, exist_ok=True)
        env["CELERY_BROKER_TRANSPORT_OPTIONS"] = json.dumps(options)
    return env


def write_secret(path: Path, data: bytes) -> None:
    """Writes a file readable only by its owner (0600 from the start, not chmod-ed after the fact), in a directory
    made 0700."""
    from devtools.dev_pki import write_private

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, data)


def secure_var_dir(var_dir: Path) -> None:
    """Make `var_dir` 0700 and everything under it owner-only (directories 0700, files 0600), creating it when it
    does not exist: a var/ made by an older up.py (0755/0644) holds the SQLite database with TOTP seeds and sessions,
    the file broker's messages, the dev PKI keys and the secrets. Symbolic links are left alone (never followed)."""
    var_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(var_dir, 0o700)
    for root, dirs, files in os.walk(var_dir):
        for names, mode in ((dirs, 0o700), (files, 0o600)):
            for name in names:
                path = os.path.join(root, name)
                try:
                    if not os.path.islink(path):
                        os.chmod(path, mode)
                except FileNotFoundError:  # consumed meanwhile (a broker message) by a process still running
                    pass


def node_name(index: int) -> str:
    """Node i (1-based): local-cpu, local-cpu-2, ... (the first keeps make up's name, so old var/ dirs still work)."""
    return "local-cpu" if index == 1 else f"local-cpu-{index}"


def node_file(index: int, stem: str) -> str:
    """node-credential, node-credential-2, ...; node-tls.pem, node-2-tls.pem, ..."""
    if stem == "credential":
        return "node-credential" if index == 1 else f"node-credential-{index}"
    return f"node-tls.{stem}" if index == 1 else f"node-{index}-tls.{stem}"


def tls_hosts() -> tuple[str, ...]:
    """The names the node certificates answer to: 127.0.0.1, localhost and KCAAS_DEV_TLS_HOSTS (comma-separated, e.g.
    the compose service names agent-1,agent-2)."""
    extra = [h.strip() for h in os.environ.get("KCAAS_DEV_TLS_HOSTS", "").split(",") if h.strip()]
    return tuple(dict.fromkeys([*DEFAULT_TLS_HOSTS, *extra]))


def dev_tls(secrets_dir: Path, *, agents: int = 1, node_dir: Path | None = None) -> dict:
    """A dev CA (secrets_dir/dev-ca.pem, engines trust it) and one server certificate per agent under node_dir
    (default secrets_dir): {"ca", "ca_key", "nodes": [{"cert", "key"}, ...]}. Made once and reused on later runs; a
    certificate is made again only when a file is missing or it expires soon."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from devtools.dev_pki import new_ca, new_server_cert, pem_cert, pem_key

    node_dir = node_dir or secrets_dir
    now = dt.datetime.now(dt.UTC)
    paths = {
        "ca": secrets_dir / "dev-ca.pem",
        "ca_key": secrets_dir / "dev-ca.key",
        "nodes": [
            {"cert": node_dir / node_file(i, "pem"), "key": node_dir / node_file(i, "key")}
            for i in range(1, agents + 1)
        ],
    }
    if paths["ca"].exists() and paths["ca_key"].exists():
        ca_key = serialization.load_pem_private_key(paths["ca_key"].read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    else:
        ca_key, ca_cert = new_ca("KCaaS make up dev CA", valid_for=dt.timedelta(days=3650))
        write_secret(paths["ca_key"], pem_key(ca_key))
        write_secret(paths["ca"], pem_cert(ca_cert))
    for index, node in enumerate(paths["nodes"], start=1):
        if node["cert"].exists() and node["key"].exists():
            cert = x509.load_pem_x509_certificate(node["cert"].read_bytes())
            if cert.issuer == ca_cert.subject and cert.not_valid_after_utc > now + dt.timedelta(days=1):
                continue
        key, cert = new_server_cert(
            ca_key, ca_cert, f"KCaaS make up node {index}", valid_for=dt.timedelta(days=365), hosts=tls_hosts()
        )
        write_secret(node["key"], pem_key(key))
        write_secret(node["cert"], pem_cert(cert))
    return paths


def manage(env: dict, *args: str) -> str:
    done = subprocess.run([PYTHON, str(REPO / "manage.py"), *args], env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip()


def bootstrap(env: dict, agents: int) -> dict:
    """migrate; the staff login, the demo key, one credential per node, the dev PKI. Idempotent (reuses var/)."""
    secrets_dir = Path(env["KCAAS_VAR_DIR"]) / "secrets"
    node_dir = Path(env.get("KCAAS_NODE_SECRETS_DIR") or secrets_dir)
    manage(env, "migrate", "--noinput")
    password = manage(env, "kcaas_local_admin", "admin", "--password-file", str(secrets_dir / "admin-password"))
    console_password_file = secrets_dir / "console-password"
    if not console_password_file.exists():
        write_secret(console_password_file, secrets.token_urlsafe(18).encode() + b"\n")
    manage(
        env,
        "console_user",
        "console",
        "--role",
        "operator",
        "--role",
        "compliance",
        "--password-file",
        str(console_password_file),
    )
    api_key = manage(env, "kcaas_create_tenant", "demo", "--reuse", "--replace", "--key-name", "make up")
    write_secret(secrets_dir / "demo-api-key", api_key.encode() + b"\n")  # for `make demo`
    credentials = [
        manage(env, "kcaas_local_node", node_name(i), "--credential-file", str(node_dir / node_file(i, "credential")))
        for i in range(1, agents + 1)
    ]
    tls = dev_tls(secrets_dir, agents=agents, node_dir=node_dir)
    return {
        "password": password,
        "api_key": api_key,
        "credentials": credentials,
        "tls": tls,
        "console_password": console_password_file.read_text().strip(),
    }


def agent_ssd_dir(env: dict, index: int) -> str:
    """Agent i's own SSD root: KCAAS_NODE_SSD_DIR (default <KCAAS_VAR_DIR>/kcaas-ssd) for agent 1, the same with
    `-<i>` for agent i. Never shared: one agent's registration clean-up and erasure purge delete the directories
    under its root that are not its own caches'."""
    base = os.environ.get("KCAAS_NODE_SSD_DIR") or str(Path(env["KCAAS_VAR_DIR"]) / "kcaas-ssd")
    return base if index == 1 else f"{base.rstrip('/')}-{index}"


def migration_listen(host: str, index: int, single: bool) -> str:
    """Agent i's mutual-TLS migration listener: KCAAS_NODE_MIGRATION_PORT + i - 1 when that is set, else port 0 (a
    free port the agent picks; it tells the control plane which in its migrate_in answer). With one agent,
    KCAAS_NODE_MIGRATION_LISTEN replaces the default."""
    if single and os.environ.get("KCAAS_NODE_MIGRATION_LISTEN"):
        return os.environ["KCAAS_NODE_MIGRATION_LISTEN"]
    base = os.environ.get("KCAAS_NODE_MIGRATION_PORT")
    return f"{host}:{int(base) + index - 1 if base else 0}"


def agent_envs(env: dict, boot: dict, agents: int, url: str, host: str, port: int) -> list[dict]:
    """One environment per agent: its credential, data-plane port (KCAAS_NODE_PORT, default the web port + 1, then
    consecutive), metrics port (KCAAS_NODE_METRICS_PORT, default the web port + 101, then consecutive), TLS files,
    migration listener (`migration_listen`) and SSD root (`agent_ssd_dir`): no two agents share a port or a
    directory. With one agent, KCAAS_NODE_ENDPOINT / KCAAS_NODE_TLS_CERT / KCAAS_NODE_TLS_KEY replace the defaults."""
    dataplane_base = int(os.environ.get("KCAAS_NODE_PORT") or port + 1)
    metrics_base = int(os.environ.get("KCAAS_NODE_METRICS_PORT") or port + 101)
    result = []
    for index, credential in enumerate(boot["credentials"], start=1):
        tls, single = boot["tls"]["nodes"][index - 1], agents == 1
        node_env = {
            **env,
            "KCAAS_CONTROL_URL": url,
            "KCAAS_NODE_CREDENTIAL": credential,
            "KCAAS_NODE_ENDPOINT": (single and os.environ.get("KCAAS_NODE_ENDPOINT"))
            or f"{host}:{dataplane_base + index - 1}",
            "KCAAS_NODE_METRICS_PORT": str(metrics_base + index - 1),
            "KCAAS_NODE_DEVICE_BYTES": os.environ.get("KCAAS_NODE_DEVICE_BYTES", str(1 << 30)),
            "KCAAS_NODE_TORCH_DEVICE": os.environ.get("KCAAS_NODE_TORCH_DEVICE", "cpu"),
            "KCAAS_NODE_TLS_CERT": (single and os.environ.get("KCAAS_NODE_TLS_CERT")) or str(tls["cert"]),
            "KCAAS_NODE_TLS_KEY": (single and os.environ.get("KCAAS_NODE_TLS_KEY")) or str(tls["key"]),
            "KCAAS_NODE_MIGRATION_LISTEN": migration_listen(host, index, single),
            "KCAAS_NODE_SSD_DIR": agent_ssd_dir(env, index),
        }
        node_env.pop("DJANGO_SETTINGS_MODULE", None)  # the node agent never loads Django
        node_env.pop("KCAAS_NODE_LISTEN", None)  # each agent binds its own endpoint
        if not single:
            node_env.pop("KCAAS_NODE_MIGRATION_ENDPOINT", None)  # each advertises its own listener
        result.append(node_env)
    return result


def children(env: dict, host: str, port: int, agents: int = 1) -> dict[str, list[str]]:
    var_dir = Path(env["KCAAS_VAR_DIR"])
    commands = {
        "web": [
            PYTHON,
            "-m",
            "gunicorn",
            "controlplane.wsgi:application",
            "--bind",
            f"{host}:{port}",
            "--workers",
            "2",
            "--worker-class",
            "gthread",
            "--threads",
            "4",
            "--log-level",
            "warning",
        ],
        "worker": [
            PYTHON,
            "-m",
            "celery",
            "--quiet",  # no startup banner: make up prints its own
            "-A",
            "controlplane",
            "worker",
            "-Q",
            "control",
            "--pool",
            "solo",
            "--loglevel",
            "warning",
            "--hostname",
            "control@%h",
        ],
        "beat": [
            PYTHON,
            "-m",
            "celery",
            "--quiet",  # no startup banner: make up prints its own
            "-A",
            "controlplane",
            "beat",
            "--loglevel",
            "warning",
            "--schedule",
            str(var_dir / "celerybeat-schedule"),
        ],
        # KV-aware routing: subscribes to the engine instances tenants register (docs/routing.md)
        "indexer": [PYTHON, str(REPO / "manage.py"), "run_kv_indexer"],
    }
    for index in range(1, agents + 1):
        commands[f"agent-{index}"] = [PYTHON, "-m", "gpu_node.agent"]
    return commands


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
    """SIGTERM to every live child, then SIGKILL to any still running after GRACE_SECONDS; returns once all are
    reaped (none is left a zombie or an orphan of make up)."""
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


def report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Child:
    """One child process and what it takes to start it again: the same command, environment and stdout. An agent's
    stdout is a pipe (wait_for_node reads its `ready` line); the others inherit up.py's. `delay` is the wait before
    its next restart (RESTART_DELAY doubling to RESTART_MAX_DELAY, back to RESTART_DELAY once a start has lived
    CRASH_WINDOW seconds); `restarts` holds the monotonic times of its restarts; `restart_at` is set only while it
    is dead and waiting for one. (A plain class: tests load this script without registering it as a module.)"""

    def __init__(self, name: str, command: list[str], env: dict, agent: bool = False):
        self.name, self.command, self.env, self.agent = name, command, env, agent
        self.proc: subprocess.Popen | None = None
        self.started, self.delay = 0.0, RESTART_DELAY
        self.restarts: list[float] = []
        self.restart_at: float | None = None

    def start(self, now: float) -> subprocess.Popen:
        """Starts it (again); `now` is the supervisor's monotonic clock."""
        self.proc = subprocess.Popen(
            self.command, env=self.env, cwd=REPO, text=True, stdout=subprocess.PIPE if self.agent else None
        )
        self.started, self.restart_at = now, None
        return self.proc


class GiveUp(Exception):
    """A reason to stop everything: the message for stderr, and up.py's exit status."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class Supervisor:
    """Watches the children once the platform is up. A control-plane child (web, worker, beat) that exits is
    reported and started again after its backoff delay; one restarted more than CRASH_RESTARTS times within
    CRASH_WINDOW seconds is a crash loop: everything stops (exit status 1). An agent that exits stops everything
    (status 0), unless survive_agent_loss, where it is only reported once and left dead (its node goes lost).
    Invariant: every process ever started is either reaped or in `processes()`, so stop_all leaves none behind; a
    restart only happens in step(), never after a stop was requested (the caller checks between steps)."""

    def __init__(self, children: list[Child], survive_agent_loss: bool):
        self.children = children
        self.survive_agent_loss = survive_agent_loss
        self.lost_agents: set[str] = set()

    def processes(self) -> dict[str, subprocess.Popen]:
        return {child.name: child.proc for child in self.children if child.proc is not None}

    def run(self, stop_requested) -> int:
        """Steps every 0.2 s until stop_requested() or a reason to stop; returns up.py's exit status."""
        try:
            while not stop_requested():
                self.step(time.monotonic())
                time.sleep(0.2)
        except GiveUp as reason:
            report(str(reason))
            return reason.status
        return 0

    def step(self, now: float) -> None:
        """Starts the children whose delay is over, deals with the ones that died; raises GiveUp to stop."""
        dead_agents = []
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    report(f"{child.name} restarted (pid {child.start(now).pid})")
            elif child.proc.poll() is None or child.name in self.lost_agents:
                continue
            elif child.agent:
                dead_agents.append(child)
            else:
                self.schedule_restart(child, now)
        if dead_agents and not self.survive_agent_loss:
            raise GiveUp(f"{', '.join(child.name for child in dead_agents)} stopped: stopping the rest")
        for child in dead_agents:
            report(f"{child.name} exited ({child.proc.returncode}): the control plane will mark its node lost")
            self.lost_agents.add(child.name)

    def schedule_restart(self, child: Child, now: float) -> None:
        rc = child.proc.returncode
        child.restarts = [t for t in child.restarts if now - t < CRASH_WINDOW]
        if len(child.restarts) >= CRASH_RESTARTS:
            raise GiveUp(
                f"{child.name} exited ({rc}) after {len(child.restarts)} restarts within {CRASH_WINDOW:g} s:"
                f" giving up, stopping the rest",
                status=1,
            )
        if now - child.started >= CRASH_WINDOW:
            child.delay = RESTART_DELAY  # it had been running fine: a fresh crash, not a loop
        report(f"{child.name} exited ({rc}): restarting in {child.delay:g} s")
        child.restarts.append(now + child.delay)
        child.restart_at = now + child.delay
        child.delay = min(child.delay * 2, RESTART_MAX_DELAY)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--agents",
        type=int,
        default=int(os.environ.get("KCAAS_AGENTS") or 1),
        help="node agents to run (default KCAAS_AGENTS, else 1)",
    )
    parser.add_argument(
        "--require-services",
        action="store_true",
        help="refuse the embedded defaults: DATABASE_URL (PostgreSQL) and REDIS_URL must be set",
    )
    parser.add_argument(
        "--survive-agent-loss",
        action="store_true",
        help="an agent that dies is reported, not a reason to stop the rest",
    )
    parser.add_argument(
        "--bootstrap-only",
        action="store_true",
        help="migrate, make the login, key, node credentials and TLS files, print them and exit",
    )
    args = parser.parse_args(argv)
    if args.agents < 1:
        parser.error("--agents must be at least 1")
    if args.require_services and not (
        os.environ.get("DATABASE_URL", "").startswith("postgres") and os.environ.get("REDIS_URL")
    ):
        parser.error("--require-services: set DATABASE_URL=postgres://... and REDIS_URL=redis://...")
    return args


def node_line(name: str, env: dict) -> str:
    """One node's line of the banner: data plane, metrics, migration listener, SSD root."""
    migration = env["KCAAS_NODE_MIGRATION_LISTEN"]
    if migration.endswith(":0"):
        migration = migration[:-2] + " (a free port)"
    return (
        f"  node {name:<11} {env['KCAAS_NODE_ENDPOINT']} (TLS 1.3 data plane), metrics "
        f"http://127.0.0.1:{env['KCAAS_NODE_METRICS_PORT']}/metrics\n"
        f"       {'':<11} migration {migration} (mutual TLS), SSD {env['KCAAS_NODE_SSD_DIR']}\n"
    )


def banner(url: str, boot: dict, node_envs: list[dict], processes: dict) -> str:
    key = boot["api_key"]
    nodes = "".join(node_line(node_name(i), env) for i, env in enumerate(node_envs, start=1))
    pids = ", ".join(f"{name}={proc.pid}" for name, proc in processes.items())
    return (
        f"\nKCaaS is up.\n"
        f"  API           {url}/api/v1/   (OpenAPI: {url}/api/schema/, docs: {url}/api/docs/)\n"
        f"  console       {url}/console/   login console / {boot['console_password']}   (operator + compliance; "
        f"the first sign-in enrols an authenticator app from a QR code)\n"
        f"  admin login   admin / {boot['password']}   (staff: HTTP basic auth on /api/v1/admin/...)\n"
        f"  demo API key  {key}\n"
        f"{nodes}"
        f"  data plane    TLS 1.3 on {', '.join(env['KCAAS_NODE_ENDPOINT'] for env in node_envs)}   "
        f"(dev CA: {boot['tls']['ca']})\n"
        f"  processes     {pids}\n"
        f"  try: curl -H 'Authorization: Bearer {key}' {url}/api/v1/whoami\n"
        f"  in another shell (kcaas, make demo, the SDK):\n"
        f"    export KCAAS_URL={url} KCAAS_API_KEY={key}\n"
        f"  operator shell: export KCAAS_URL={url} KCAAS_ADMIN_USER=admin KCAAS_ADMIN_PASSWORD={boot['password']}\n"
        f"    (kcaas admin tenants create NAME, kcaas admin keys create --tenant NAME, kcaas.admin())\n"
        f"Ctrl-C stops everything."
    )


def api_address() -> tuple[str, int]:
    """Where the API listens: KCAAS_URL's host and port when it is set (the variable `make demo` and `kcaas` read,
    so one export serves all three), else KCAAS_HOST / KCAAS_PORT (default 127.0.0.1:8000)."""
    url = os.environ.get("KCAAS_URL", "").strip()
    if not url:
        return os.environ.get("KCAAS_HOST", "127.0.0.1"), int(os.environ.get("KCAAS_PORT", "8000"))
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/") or parts.query:
        raise SystemExit(
            f"make up: KCAAS_URL={url!r} is not http://HOST:PORT (make up serves plain HTTP); unset it, "
            "or use KCAAS_HOST / KCAAS_PORT"
        )
    return parts.hostname, port


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.umask(PRIVATE_UMASK)  # before anything is made under var/; every child inherits it
    host, port = api_address()
    url = f"http://{host}:{port}"
    env = base_env()
    secure_var_dir(Path(env["KCAAS_VAR_DIR"]))
    boot = bootstrap(env, args.agents)
    if args.bootstrap_only:
        nodes = ", ".join(f"{node_name(i)} ({node_file(i, 'credential')})" for i in range(1, args.agents + 1))
        print(
            f"bootstrapped: admin / {boot['password']}; demo API key {boot['api_key']}; nodes {nodes}; "
            f"dev CA {boot['tls']['ca']}",
            flush=True,
        )
        return 0
    node_envs = agent_envs(env, boot, args.agents, url, host, port)
    stop_requested: list[int] = []  # appended to by the signal handler; read between supervision steps
    signal.signal(signal.SIGINT, lambda signum, _: stop_requested.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _: stop_requested.append(signum))
    supervisor = Supervisor([], args.survive_agent_loss)
    try:
        start_children(supervisor, env, node_envs, url, host, port)
        print(banner(url, boot, node_envs, supervisor.processes()), flush=True)
        status = supervisor.run(lambda: bool(stop_requested))
    except RuntimeError as error:
        report(f"make up: {error}")
        return 1
    finally:
        stop_all(supervisor.processes())
    print("stopped", flush=True)
    return status


def start_children(supervisor: Supervisor, env: dict, node_envs: list[dict], url: str, host: str, port: int) -> None:
    """Starts web, worker, beat, then (once the web server answers: agents register over HTTP) the agents, and
    waits until every agent has registered. Each started child is in supervisor.children at once, so a failure
    here (RuntimeError: a child died during start-up, no restarts yet) still stops all of them."""
    for name, command in children(env, host, port, len(node_envs)).items():
        agent = name.startswith("agent-")
        if name == "agent-1":
            wait_until_up(url, supervisor.processes())
        child = Child(name, command, node_envs[int(name[6:]) - 1] if agent else env, agent=agent)
        supervisor.children.append(child)
        child.start(time.monotonic())
    for child in supervisor.children:
        if child.agent:
            wait_for_node(child.proc)


if __name__ == "__main__":
    raise SystemExit(main())
