"""The network tier's store processes for local runs and tests: one Mooncake master (metadata, leases, eviction, with
its embedded HTTP metadata server) and N store servers (`mooncake_client`, each mounting a memory segment), all on
loopback, each on a free port picked by binding port 0 (or the one asked for), logged under `workdir`.

`StoreServices(workdir).start()` returns once the store is usable, waited on by condition with a deadline, never a
fixed sleep: the master's RPC port accepts, its `/health` answers `service_ready`, its `master_total_capacity_bytes`
counts every store server's segment, and a pure client (a child process: this one never mounts a client) puts, gets
and removes a probe object. The node agents reach the store through KCAAS_NETWORK_STORE_MASTER and
KCAAS_NETWORK_STORE_METADATA (`StoreEndpoints.env()`).

Invariants: every process this class starts is in `self._procs` from the moment it is spawned, so `stop()` (also
after a failed start) ends all of them: SIGCONT first (a stopped master cannot act on SIGTERM), SIGTERM, then SIGKILL
after a grace period, and waits for each; `stop()` is idempotent. The binaries are the venv's (next to
sys.executable), else PATH's; the pip wrappers exec the real binary, so a child's pid is the store process's.

`python -m devtools.store_services` runs them in the foreground, prints the two env lines and stops them on
Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MASTER_ENV = "KCAAS_NETWORK_STORE_MASTER"
METADATA_ENV = "KCAAS_NETWORK_STORE_METADATA"
HOST = "127.0.0.1"
MIB = 1 << 20

# A pure client (no segment) that puts, reads back and removes one object: argv = master, metadata URL, key.
_PROBE = """
import sys
from mooncake.store import MooncakeDistributedStore
master, metadata, key = sys.argv[1:4]
store = MooncakeDistributedStore()
if store.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master) != 0:
    sys.exit("setup failed")
payload = b"kcaas-store-probe" * 64
if store.put(key, payload) != 0:
    sys.exit("put failed")
if store.get(key) != payload:
    sys.exit("get returned other bytes")
store.remove(key, True)
store.close()
"""


class StoreStartError(RuntimeError):
    """The store's processes did not become ready before the deadline (the message names what, and the log)."""


def find_binary(name: str) -> str:
    """The venv's binary (next to sys.executable), else the one on PATH; StoreStartError when neither exists."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise StoreStartError(f"{name} not found next to {sys.executable} nor on PATH: `make install` (the network extra)")


def mooncake_importable() -> bool:
    """Whether this interpreter has the Mooncake Store package (the `network` extra)."""
    import importlib.util

    return importlib.util.find_spec("mooncake") is not None


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports no one listens on now (each bound to port 0, all held until every one is
    picked, then released)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((HOST, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def accepting(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class StoreEndpoints:
    """Where the store answers: `master` is HOST:RPC_PORT, `metadata_url` the HTTP metadata server's URL."""

    master: str
    metadata_url: str
    metrics_port: int
    master_pid: int
    store_server_pids: tuple[int, ...]

    def env(self) -> dict[str, str]:
        """The variables a node agent reads."""
        return {MASTER_ENV: self.master, METADATA_ENV: self.metadata_url}


@dataclass
class _Ports:
    rpc: int
    metadata: int
    metrics: int
    servers: list[int] = field(default_factory=list)


class StoreServices:
    """One master and `num_store_servers` store servers; see the module docstring for the invariants."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        segment_bytes: int = 256 * MIB,
        num_store_servers: int = 1,
        lease_ttl_ms: int = 200,
        eviction_high_watermark: float = 0.95,
        eviction_ratio: float = 0.05,
        client_ttl_s: int = 10,
        ready_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
        master_port: int = 0,
        metadata_port: int = 0,
        metrics_port: int = 0,
    ) -> None:
        if num_store_servers < 1 or segment_bytes < 16 * MIB:
            raise ValueError("at least one store server, each with a segment of at least 16 MiB")
        self.workdir = Path(workdir)
        self.segment_bytes = segment_bytes
        self.num_store_servers = num_store_servers
        self.lease_ttl_ms = lease_ttl_ms
        self.eviction_high_watermark = eviction_high_watermark
        self.eviction_ratio = eviction_ratio
        self.client_ttl_s = client_ttl_s
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self._asked = (master_port, metadata_port, metrics_port)
        self._ports: _Ports | None = None
        self._master: subprocess.Popen | None = None
        self._servers: list[subprocess.Popen] = []
        self._endpoints: StoreEndpoints | None = None

    # --- life cycle ---------------------------------------------------------------------------------------------

    def start(self) -> StoreEndpoints:
        """Starts the master, then the store servers, and waits until a pure client's probe succeeds. On any
        failure every started process is stopped and StoreStartError says what did not come up."""
        if self._master is not None:
            raise RuntimeError("StoreServices already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        picked = free_ports(3 + self.num_store_servers)
        rpc, metadata, metrics = (asked or free for asked, free in zip(self._asked, picked))
        self._ports = _Ports(rpc, metadata, metrics, servers=picked[3:])
        try:
            self._master = self._spawn("master", self._master_command())
            self._wait_for_master()
            for index in range(self.num_store_servers):
                self._servers.append(self._spawn(f"store-server-{index}", self._server_command(index)))
            self._wait_for_capacity(self.num_store_servers * self.segment_bytes)
            self.probe(deadline=time.monotonic() + self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self._endpoints = StoreEndpoints(
            master=f"{HOST}:{rpc}",
            metadata_url=f"http://{HOST}:{metadata}/metadata",
            metrics_port=metrics,
            master_pid=self._master.pid,
            store_server_pids=tuple(proc.pid for proc in self._servers),
        )
        return self._endpoints

    @property
    def endpoints(self) -> StoreEndpoints:
        if self._endpoints is None:
            raise RuntimeError("StoreServices not started")
        return self._endpoints

    def stop(self) -> None:
        """Ends every process this object started and waits for each: the store servers first (they unmount their
        segments while the master still answers), then the master."""
        self._terminate(self._servers)
        if self._master is not None:
            self._terminate([self._master])

    def _terminate(self, procs: list[subprocess.Popen]) -> None:
        """SIGCONT and SIGTERM to each, then SIGKILL to any still running after the grace period; all reaped."""
        for proc in procs:
            _signal(proc, signal.SIGCONT)
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()

    def pids(self) -> list[int]:
        """The pids of the processes this object started that have not exited."""
        procs = [*self._servers, *([self._master] if self._master is not None else [])]
        return [proc.pid for proc in procs if proc.poll() is None]

    def dead(self) -> list[str]:
        """The names of started processes that have exited (for a foreground run's supervision)."""
        named = [("master", self._master), *((f"store-server-{i}", p) for i, p in enumerate(self._servers))]
        return [name for name, proc in named if proc is not None and proc.poll() is not None]

    # --- faults, for tests ----------------------------------------------------------------------------------------

    def kill_store_server(self, index: int) -> None:
        """SIGKILL store server `index` and reap it: the objects in its segment are lost."""
        proc = self._servers[index]
        _signal(proc, signal.SIGKILL)
        proc.wait()

    def stop_master(self) -> None:
        """SIGSTOP the master and wait until it is stopped: its ports still accept connections, nothing answers
        (a hung store)."""
        assert self._master is not None
        _signal(self._master, signal.SIGSTOP)
        self._wait("the master stopped", lambda: _stopped(self._master), check_alive=False)

    def resume_master(self) -> None:
        """SIGCONT the master and wait until it runs and answers /health again."""
        assert self._master is not None
        _signal(self._master, signal.SIGCONT)
        self._wait("the master resumed", lambda: not _stopped(self._master) and self._service_ready())

    def kill_master(self) -> None:
        """SIGKILL the master and reap it (the store servers keep running, masterless)."""
        assert self._master is not None
        _signal(self._master, signal.SIGKILL)
        self._master.wait()

    # --- readiness ----------------------------------------------------------------------------------------------

    def health(self, timeout: float = 1.0) -> dict | None:
        """The master's /health answer, or None when it does not answer within `timeout`."""
        try:
            with urllib.request.urlopen(self._metrics_url("/health"), timeout=timeout) as answer:
                return json.loads(answer.read())
        except (OSError, ValueError):
            return None

    def capacity_bytes(self, timeout: float = 1.0) -> int | None:
        """The master's `master_total_capacity_bytes` (the mounted segments), or None when it does not answer."""
        try:
            with urllib.request.urlopen(self._metrics_url("/metrics"), timeout=timeout) as answer:
                text = answer.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return None

    def probe(self, *, deadline: float) -> None:
        """A pure client in a child process puts, gets and removes one object; retried until it succeeds or the
        deadline passes (then StoreStartError with the probe's last output)."""
        assert self._ports is not None
        master, metadata = f"{HOST}:{self._ports.rpc}", f"http://{HOST}:{self._ports.metadata}/metadata"
        last = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreStartError(f"the store's probe did not succeed: {last[-2000:]} (logs in {self.workdir})")
            key = f"kcaas-probe/{os.getpid()}/{time.monotonic_ns()}"
            try:
                done = subprocess.run(
                    [sys.executable, "-c", _PROBE, master, metadata, key],
                    cwd=self.workdir,
                    capture_output=True,
                    text=True,
                    timeout=min(remaining, 30.0),
                )
            except subprocess.TimeoutExpired:
                last = "the probe timed out"
                continue
            if done.returncode == 0:
                return
            last = done.stderr
            self._check_alive()
            time.sleep(0.2)  # back off between child processes, within the deadline

    def _wait_for_master(self) -> None:
        assert self._ports is not None
        rpc = self._ports.rpc
        self._wait("the master's RPC port and /health", lambda: accepting(rpc) and self._service_ready())

    def _service_ready(self) -> bool:
        answer = self.health()
        return bool(answer and answer.get("status") == "ok" and answer.get("service_ready"))

    def _wait_for_capacity(self, expected: int) -> None:
        self._wait(f"{expected} bytes of mounted segments", lambda: (self.capacity_bytes() or 0) >= expected)

    def _wait(self, what: str, condition, *, check_alive: bool = True) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not condition():
            if check_alive:
                self._check_alive()
            if time.monotonic() >= deadline:
                raise StoreStartError(f"{what}: not ready after {self.ready_timeout_s:.0f} s (logs in {self.workdir})")
            time.sleep(0.05)

    def _check_alive(self) -> None:
        for name in self.dead():
            log = self.workdir / f"{name}.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise StoreStartError(f"the store's {name} exited during start-up ({log}):\n{tail}")

    # --- processes ----------------------------------------------------------------------------------------------

    def _master_command(self) -> list[str]:
        assert self._ports is not None
        ports = self._ports
        return [
            find_binary("mooncake_master"),
            f"--rpc_port={ports.rpc}",
            f"--rpc_address={HOST}",
            f"--metrics_port={ports.metrics}",
            f"--metrics_host={HOST}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={ports.metadata}",
            f"--http_metadata_server_host={HOST}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--eviction_high_watermark_ratio={self.eviction_high_watermark}",
            f"--eviction_ratio={self.eviction_ratio}",
            f"--client_ttl={self.client_ttl_s}",
            "--enable_metadata_cleanup_on_timeout=true",
        ]

    def _server_command(self, index: int) -> list[str]:
        assert self._ports is not None
        ports = self._ports
        return [
            find_binary("mooncake_client"),
            f"--global_segment_size={self.segment_bytes}",
            f"--host={HOST}",
            f"--master_server_address={HOST}:{ports.rpc}",
            f"--metadata_server=http://{HOST}:{ports.metadata}/metadata",
            f"--port={ports.servers[index]}",
            "--protocol=tcp",
        ]

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                command, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _metrics_url(self, path: str) -> str:
        assert self._ports is not None
        return f"http://{HOST}:{self._ports.metrics}{path}"


def _stopped(proc: subprocess.Popen | None) -> bool:
    """Whether the child is in the stopped state (SIGSTOP delivered), read from /proc/PID/stat."""
    if proc is None or proc.returncode is not None:
        return False
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def _signal(proc: subprocess.Popen, signum: int) -> None:
    """Signals a child this module started, by its pid, unless it has been reaped."""
    if proc.returncode is None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass


# --- foreground run -------------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.store_services", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=os.path.join("var", "network-store"), help="logs (default %(default)s)")
    parser.add_argument("--segment-bytes", type=int, default=256 * MIB, help="each store server's segment")
    parser.add_argument("--store-servers", type=int, default=1)
    parser.add_argument("--lease-ttl-ms", type=int, default=200)
    parser.add_argument("--eviction-high-watermark", type=float, default=0.95)
    parser.add_argument("--eviction-ratio", type=float, default=0.05)
    parser.add_argument("--master-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--metadata-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--metrics-port", type=int, default=0, help="0: a free port")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Starts the store, prints `NAME=value` lines for the agents, supervises until a signal or a process dies."""
    args = _parse_args(argv)
    services = StoreServices(
        args.workdir,
        segment_bytes=args.segment_bytes,
        num_store_servers=args.store_servers,
        lease_ttl_ms=args.lease_ttl_ms,
        eviction_high_watermark=args.eviction_high_watermark,
        eviction_ratio=args.eviction_ratio,
        master_port=args.master_port,
        metadata_port=args.metadata_port,
        metrics_port=args.metrics_port,
    )
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        endpoints = services.start()
        for name, value in endpoints.env().items():
            print(f"{name}={value}", flush=True)
        print(
            f"# store: master pid {endpoints.master_pid}, store servers {list(endpoints.store_server_pids)}, "
            f"metrics http://{HOST}:{endpoints.metrics_port}/metrics, logs in {args.workdir}; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        while not stopping.wait(1.0):
            if services.dead():
                print(f"store: {', '.join(services.dead())} exited; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    except StoreStartError as error:
        print(f"store: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        services.stop()


if __name__ == "__main__":
    raise SystemExit(main())
