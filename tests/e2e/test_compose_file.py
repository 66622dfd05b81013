"""docker-compose.yml, docker-compose.gpu.yml, the Dockerfile and the container entry point, checked without Docker:
the compose file parses and has the topology of `make cluster`; every variable AgentConfig.from_env requires is given
to both agents (directly, or as NAME_FILE that the entry point turns into NAME); what the agents read is what the
bootstrap service writes (scripts/up.py's file names); each agent has its own SSD volume and a migration listener
the other agents can reach; the network tier's store (store-master, store-server) is where the agents and the store
server look for it, with flags its binaries accept; every image, build file, module and script a command names
exists; the GPU override reserves one GPU per agent."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpu_node.agent.process import AgentConfig

REPO = Path(__file__).resolve().parents[2]
STORE = {"store-master", "store-server"}
SERVICES = {"postgres", "redis", "bootstrap", "controlplane", "worker", "beat", "agent-1", "agent-2", *STORE}
AGENTS = ("agent-1", "agent-2")
NODE_DIR = "/var/lib/kcaas-nodes"


def load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


def resolve(value) -> str:
    """Compose interpolation with the variables unset: ${NAME:-default} -> default, ${NAME} -> ''."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", str(value))


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {name: resolve(value) for name, value in env.items()}


def entrypoint_file_vars() -> set[str]:
    script = (REPO / "scripts" / "container-entrypoint.sh").read_text()
    return set(re.search(r"^for name in ([A-Z_ ]+); do", script, re.M).group(1).split())


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("docker-compose.yml")


@pytest.fixture(scope="module")
def up_module():
    spec = importlib.util.spec_from_file_location("kcaas_up_script", REPO / "scripts" / "up.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_compose_file_has_the_cluster_topology(compose):
    services = compose["services"]
    assert SERVICES <= set(services)
    assert services["postgres"]["image"] == "postgres:15" and services["redis"]["image"] == "redis:7"
    for name in SERVICES - {"postgres", "redis"}:
        build = services[name]["build"]
        assert (REPO / build["context"] / build["dockerfile"]).is_file(), name
    for name, service in services.items():
        for dependency in service.get("depends_on") or {}:
            assert dependency in services, f"{name} depends on a missing {dependency}"
        for volume in service.get("volumes") or []:
            source = volume.split(":", 1)[0]
            assert source in (compose.get("volumes") or {}), f"{name} mounts an undeclared volume {source}"
    # migrations and credentials come first: everything of ours waits for the one-shot bootstrap
    for name in SERVICES - {"postgres", "redis", "bootstrap", *STORE}:
        assert services[name]["depends_on"]["bootstrap"]["condition"] == "service_completed_successfully", name
    assert services["bootstrap"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["bootstrap"].get("restart") == "no"


def test_every_variable_an_agent_needs_is_set_for_both_agents(compose):
    required = set(re.findall(r'required\("([A-Z_]+)"\)', inspect.getsource(AgentConfig.from_env)))
    assert {"KCAAS_CONTROL_URL", "KCAAS_NODE_CREDENTIAL", "CELERY_BROKER_URL", "KCAAS_NODE_ENDPOINT"} <= required
    from_files = entrypoint_file_vars()
    seen = {}
    for name in AGENTS:
        env = environment(compose["services"][name])
        for variable in required:
            if not env.get(variable):
                assert variable in from_files and env.get(f"{variable}_FILE"), f"{name}: {variable} is not set"
        assert env["KCAAS_NODE_TLS_CERT"] and env["KCAAS_NODE_TLS_KEY"], f"{name} must serve the TLS data plane"
        assert env["KCAAS_CONTROL_URL"] == "http://controlplane:8000"
        config = AgentConfig.from_env({**env, "KCAAS_NODE_CREDENTIAL": "kc_node_placeholder"})  # parses as given
        assert config.device_capacity_bytes > 0 and config.metrics_port
        listen_port = env["KCAAS_NODE_LISTEN"].rpartition(":")[2]
        assert any(str(port).endswith(f":{listen_port}:{listen_port}") for port in compose["services"][name]["ports"])
        seen[name] = (
            env["KCAAS_NODE_CREDENTIAL_FILE"],
            env["KCAAS_NODE_TLS_CERT"],
            env["KCAAS_NODE_TLS_KEY"],
            env["KCAAS_NODE_ENDPOINT"],
            listen_port,
            env["KCAAS_NODE_METRICS_PORT"],
        )
    for first, second in zip(*seen.values()):
        assert first != second  # own credential, certificate, key, endpoint, data-plane and metrics ports
    # the agents and the control plane use the same broker
    assert {environment(compose["services"][n])["CELERY_BROKER_URL"] for n in ("worker", "beat", *AGENTS)} == {
        "redis://redis:6379/1"
    }


def test_agents_read_what_the_bootstrap_service_writes(compose, up_module, monkeypatch):
    services = compose["services"]
    bootstrap = services["bootstrap"]
    env = environment(bootstrap)
    assert env["KCAAS_NODE_SECRETS_DIR"] == NODE_DIR
    assert int(env["KCAAS_AGENTS"]) >= len(AGENTS)
    assert set(AGENTS) <= set(env["KCAAS_DEV_TLS_HOSTS"].split(","))  # certificates valid for the service names
    assert any(
        volume.startswith(f"kcaas-nodes:{NODE_DIR}") and not volume.endswith(":ro") for volume in bootstrap["volumes"]
    )
    for index, name in enumerate(AGENTS, start=1):
        agent_env = environment(services[name])
        assert agent_env["KCAAS_NODE_CREDENTIAL_FILE"] == f"{NODE_DIR}/{up_module.node_file(index, 'credential')}"
        assert agent_env["KCAAS_NODE_TLS_CERT"] == f"{NODE_DIR}/{up_module.node_file(index, 'pem')}"
        assert agent_env["KCAAS_NODE_TLS_KEY"] == f"{NODE_DIR}/{up_module.node_file(index, 'key')}"
        assert f"kcaas-nodes:{NODE_DIR}:ro" in services[name]["volumes"]  # agents cannot touch the rest
    # the bootstrap command is one scripts/up.py accepts
    command = bootstrap["command"]
    assert command[:2] == ["python", "scripts/up.py"] and "--bootstrap-only" in command
    monkeypatch.setenv("DATABASE_URL", env["DATABASE_URL"])
    monkeypatch.setenv("REDIS_URL", env["REDIS_URL"])
    args = up_module.parse_args(command[2:])
    assert args.bootstrap_only and args.require_services


def command_targets_exist(command: list[str]) -> None:
    command = [resolve(part) for part in command]
    if command[0] in {"redis-server"}:
        return
    if command[0] in {"mooncake_master", "mooncake_client"}:
        store_flags_accepted(command)
        return
    assert command[0] == "python", command
    if command[1] != "-m":
        assert (REPO / command[1]).is_file(), command
        return
    module = command[2]
    in_repo = [REPO / (module.replace(".", "/") + ".py"), REPO / module.replace(".", "/") / "__main__.py"]
    assert any(path.is_file() for path in in_repo) or importlib.util.find_spec(module), command
    if module == "gunicorn":
        app_module, _, attribute = command[3].partition(":")
        source = REPO / "platform" / (app_module.replace(".", "/") + ".py")
        assert re.search(rf"^{attribute} = ", source.read_text(), re.M), command
    if module == "celery":
        app = command[command.index("-A") + 1]  # celery looks for `<app>.app`, then `<app>.celery`
        package = REPO / "platform" / app
        exported = re.search(r"^(from \S+ import (\S+ as )?app\b|app = )", (package / "__init__.py").read_text(), re.M)
        assert exported or (package / "celery.py").is_file(), command


def store_flags_accepted(command: list[str]) -> None:
    """Every --flag of a store command is one its binary (the network extra's, when installed here) lists."""
    from devtools.store_services import find_binary, mooncake_importable

    assert re.search(r'^network = \[\n\s+"mooncake-transfer-engine', (REPO / "pyproject.toml").read_text(), re.M)
    if not mooncake_importable():
        return
    listed = subprocess.run([find_binary(command[0]), "--help"], capture_output=True, text=True, timeout=30)
    known = set(re.findall(r"^\s+-(\w+) \(", listed.stdout + listed.stderr, re.M))
    for flag in command[1:]:
        assert flag.startswith("--") and flag[2:].split("=", 1)[0] in known, (command[0], flag)


def flag(command: list[str], name: str) -> str:
    (value,) = [resolve(part).split("=", 1)[1] for part in command if part.startswith(f"--{name}=")]
    return value


def test_the_agents_and_the_store_server_find_the_network_store(compose):
    services = compose["services"]
    master, server = services["store-master"]["command"], services["store-server"]["command"]
    rpc, metadata = flag(master, "rpc_port"), flag(master, "http_metadata_server_port")
    assert flag(master, "enable_http_metadata_server") == "true"
    assert flag(server, "master_server_address") == f"store-master:{rpc}"
    assert flag(server, "metadata_server") == f"http://store-master:{metadata}/metadata"
    assert flag(server, "host") == "store-server"  # the name the agents' transfer engines resolve
    assert services["store-server"]["depends_on"]["store-master"]["condition"] == "service_healthy"
    metrics_port = flag(master, "metrics_port")
    assert f"127.0.0.1:{metrics_port}/health" in " ".join(services["store-master"]["healthcheck"]["test"])
    assert f"127.0.0.1:{flag(server, 'http_port')}/health" in " ".join(services["store-server"]["healthcheck"]["test"])
    # what caches may ask of the store is its segment
    assert environment(services["controlplane"])["KCAAS_NETWORK_STORE_BYTES"] == flag(server, "global_segment_size")
    for name in AGENTS:
        config = AgentConfig.from_env({**environment(services[name]), "KCAAS_NODE_CREDENTIAL": "kc_node_placeholder"})
        assert config.network_store_master == f"store-master:{rpc}", name
        assert config.network_store_metadata == f"http://store-master:{metadata}/metadata", name
        assert services[name]["depends_on"]["store-server"]["condition"] == "service_healthy", name


def test_every_command_names_something_that_exists(compose):
    for service in compose["services"].values():
        if "command" in service and "build" in service:
            command_targets_exist(service["command"])
    dockerfile = (REPO / "Dockerfile").read_text()
    entrypoint = re.search(r'^ENTRYPOINT \["([^"]+)"\]', dockerfile, re.M).group(1)
    assert entrypoint.startswith("/app/")
    script = REPO / entrypoint.removeprefix("/app/")
    assert script.is_file() and os.access(script, os.X_OK)
    command_targets_exist(re.findall(r'"([^"]+)"', re.search(r"^CMD (\[.*\])", dockerfile, re.M).group(1)))
    # the image installs a lock (exact, hashed), and puts the source roots on the path as scripts/server_env.py does
    lock = re.search(r"pip install --require-hashes -r (\S+)", dockerfile).group(1)
    assert (REPO / lock).is_file() and lock.startswith("locks/")
    python_path = re.search(r"PYTHONPATH=(\S+)", dockerfile).group(1).split(":")
    assert {"/app", "/app/platform", "/app/kernels"} <= set(python_path)
    assert "python scripts/server_env.py" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "var", ".git"} <= set(ignored) and not {"locks", "locks/"} & set(ignored)


def test_the_entrypoint_turns_name_file_into_name(tmp_path):
    script = REPO / "scripts" / "container-entrypoint.sh"
    (tmp_path / "credential").write_text("kc_node_from_a_file\n")
    env = {"PATH": os.environ["PATH"], "KCAAS_NODE_CREDENTIAL_FILE": str(tmp_path / "credential")}
    show = [str(script), sys.executable, "-c", "import os; print(repr(os.environ['KCAAS_NODE_CREDENTIAL']))"]
    assert subprocess.run(show, env=env, capture_output=True, text=True, check=True).stdout == "'kc_node_from_a_file'\n"
    given = subprocess.run(show, env={**env, "KCAAS_NODE_CREDENTIAL": "kc_node_given"}, capture_output=True, text=True)
    assert given.stdout == "'kc_node_given'\n"  # a value set directly wins
    missing = subprocess.run(
        [str(script), "true"], env={**env, "KCAAS_NODE_CREDENTIAL_FILE": "/nonexistent"}, capture_output=True, text=True
    )
    assert missing.returncode == 1 and "not readable" in missing.stderr


def test_the_gpu_override_gives_each_agent_a_gpu(compose):
    gpu = load("docker-compose.gpu.yml")
    assert set(gpu["services"]) == set(AGENTS)
    device_ids = []
    for name in AGENTS:
        service = gpu["services"][name]
        assert environment(service)["KCAAS_NODE_TORCH_DEVICE"] == "cuda:0"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        device_ids.append(resolve(device["device_ids"][0]))
    assert device_ids == ["0", "1"]


def mount_of(path: str, volumes: list[str]) -> tuple[str, str, str]:
    """(volume, mount point, mode) of the mount `path` lies on."""
    for volume in volumes:
        source, target, *mode = volume.split(":")
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source, target, (mode or ["rw"])[0]
    raise AssertionError(f"{path} is on no volume: it would be lost with the container")


def test_each_agent_has_its_own_ssd_volume_and_migration_listener(compose):
    """A drain moves caches between the agents: each listens for migrations (mutual TLS on its platform identity)
    and advertises its service name, and keeps its SSD tier on a volume no other service mounts, writable by the
    image's non-root user (a fresh named volume takes the owner of the image directory it is mounted on)."""
    services, dockerfile = compose["services"], (REPO / "Dockerfile").read_text()
    owned = re.search(r"chown kcaas:kcaas ([^&\n]+)", dockerfile).group(1).split()
    volumes, endpoints = [], []
    for name in AGENTS:
        env = environment(services[name])
        config = AgentConfig.from_env({**env, "KCAAS_NODE_CREDENTIAL": "kc_node_placeholder"})
        assert config.identity and config.migration_listen and config.ssd_dir, name
        listen_port = config.migration_listen.rpartition(":")[2]
        assert config.migration_endpoint == f"{name}:{listen_port}"  # what the other agents dial on the network
        source, target, mode = mount_of(config.ssd_dir, services[name]["volumes"])
        assert mode != "ro", f"{name}: its SSD volume is read-only"
        assert target in owned, f"{name}: {target} is not owned by the image's kcaas user"
        others = [
            n
            for n, s in services.items()
            if n != name and any(v.startswith(f"{source}:") for v in s.get("volumes") or [])
        ]
        assert others == [], f"{name}'s SSD volume {source} is mounted by {others} too"
        volumes.append(source)
        endpoints.append(config.migration_endpoint)
    assert len(set(volumes)) == len(AGENTS) and len(set(endpoints)) == len(AGENTS)
