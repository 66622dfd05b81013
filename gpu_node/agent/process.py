"""The node agent process: one per GPU (or per CPU host). It registers with the control plane, renews its lease by
heartbeat, and consumes its own Celery queue in process (the pool that holds the caches must run the tasks).

    python -m gpu_node.agent        # configuration from the environment (AgentConfig.from_env); __main__.py

Lifecycle as explicit steps: `start()` = registry -> register -> Celery worker -> heartbeat; `stop()` undoes them
in reverse order, logging (not raising) errors. SIGTERM/SIGINT handlers only set a flag; the main thread sees it
and stops: the data plane drains (accepts nothing new, answers every request that has started arriving, closes idle
connections; at most KCAAS_NODE_DRAIN_SECONDS), the heartbeat stops after one last report of what the node holds,
the worker finishes the task in hand (acks_late: one interrupted mid-way is redelivered), the process exits 0.
The data-plane server (gpu_node/dataplane/server.py) is the last start step and the first stop step; it runs when TLS
files (KCAAS_NODE_TLS_CERT/KCAAS_NODE_TLS_KEY) or a Unix socket (KCAAS_NODE_UDS) are set.

Usage: a UsageReporter (gpu_node/agent/usage.py) sends the registry's usage snapshot every
KCAAS_NODE_USAGE_SECONDS (60) on its own thread, unsent reports retried in order; stop() sends a last one.

Revoked data tokens: one RevocationList per agent, read by the data plane's TokenVerifier and fed by the
`revoke_tokens` task and by every register and heartbeat answer (`revoked_tokens`).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpu_node.agent.metrics import NodeMetrics
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from gpu_node.agent.usage import UsageReporter, UsageReportLoop
from gpu_node.dataplane.admission import NodeLimits, TenantLimits
from gpu_node.dataplane.tokens import RevocationList
from gpu_node.errors import NodeError
from gpu_node.tiers.host_memory import keep_block_buffers_on_heap
from kcaas.node_protocol.messages import node_queue

if TYPE_CHECKING:
    from gpu_node.agent.identity import NodeIdentity, RenewalLoop
    from gpu_node.dataplane.server import DataPlaneServer
    from gpu_node.migration.transfer import MigrationListener
    from kcaas.node_protocol.sealing import NodeSealingKey

logger = logging.getLogger("kcaas.node.agent")
WORKER_STOP_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class AgentConfig:
    control_url: str  # the control plane's base URL, e.g. http://127.0.0.1:8000
    credential: str  # kc_node_... issued by staff (POST /api/v1/admin/nodes)
    broker_url: str  # the Celery broker the control plane sends this node's tasks through
    endpoint: str  # host:port of this node's data plane, as clients should reach it
    device_capacity_bytes: int
    dram_capacity_bytes: int = 0
    ssd_capacity_bytes: int = 0
    ssd_dir: str | None = None  # KCAAS_NODE_SSD_DIR: caches' SSD tiers (default var/kcaas-ssd under the working dir)
    device: str | None = None  # torch device for the pools; default cuda when present, else cpu
    broker_transport_options: dict | None = None  # e.g. the folders of the file-system broker of `make up`
    metrics_port: int | None = None  # Prometheus /metrics on <metrics_addr>:<port> (KCAAS_NODE_METRICS_PORT)
    metrics_addr: str = "127.0.0.1"  # KCAAS_NODE_METRICS_ADDR: 0.0.0.0 in a container scraped from outside
    tls_cert_file: str | None = None  # the data plane's certificate chain (PEM); with tls_key_file: TLS 1.3 listener
    tls_key_file: str | None = None
    listen: str | None = None  # host:port the data plane binds (default: endpoint)
    uds_path: str | None = None  # a Unix socket for engines on this host (same token auth, no TLS)
    migration_listen: str | None = None  # KCAAS_NODE_MIGRATION_LISTEN host:port: mutual-TLS migration listener
    migration_endpoint: str | None = None  # KCAAS_NODE_MIGRATION_ENDPOINT host:port other nodes dial (default below)
    migration_max_bytes_per_second: float | None = None  # KCAAS_NODE_MIGRATION_MAX_BYTES_PER_SECOND: sender cap
    token_issuer: str = "kcaas-control-plane"  # the `iss` of data tokens (the control plane's KCAAS_TOKEN_ISSUER)
    drain_seconds: float = 20.0  # SIGTERM: how long in-flight data-plane requests may take to finish
    tenant_limits: TenantLimits = TenantLimits()  # per-tenant data-plane connections / requests / staged bytes
    node_limits: NodeLimits = NodeLimits()  # before authentication (per source, HELLO deadline) and node staging
    usage_seconds: float = 60.0  # KCAAS_NODE_USAGE_SECONDS: how often usage reports go to the control plane
    identity: bool = True  # KCAAS_NODE_IDENTITY: send a CSR at register, hold a platform certificate (identity.py)
    identity_dir: str | None = None  # KCAAS_NODE_IDENTITY_DIR: persist key + certificate there (0600); else memory
    tls_from_identity: bool = False  # KCAAS_NODE_TLS_FROM_IDENTITY: no TLS files -> data plane on the platform cert
    network_store_master: str | None = None  # KCAAS_NETWORK_STORE_MASTER host:port of the fleet's Mooncake master
    network_store_metadata: str | None = None  # KCAAS_NETWORK_STORE_METADATA http://host:port/metadata
    network_store_timeout: float = 1.0  # KCAAS_NETWORK_STORE_TIMEOUT_S: the deadline of one store call

    @classmethod
    def from_env(cls, environ=os.environ) -> AgentConfig:
        def required(name: str) -> str:
            value = environ.get(name, "")
            if not value:
                raise SystemExit(f"gpu_node.agent.process: set {name}")
            return value

        return cls(
            control_url=required("KCAAS_CONTROL_URL").rstrip("/"),
            credential=required("KCAAS_NODE_CREDENTIAL"),
            broker_url=required("CELERY_BROKER_URL"),
            endpoint=required("KCAAS_NODE_ENDPOINT"),
            device_capacity_bytes=int(required("KCAAS_NODE_DEVICE_BYTES")),
            dram_capacity_bytes=int(environ.get("KCAAS_NODE_DRAM_BYTES", 0)),
            ssd_capacity_bytes=int(environ.get("KCAAS_NODE_SSD_BYTES", 0)),
            ssd_dir=environ.get("KCAAS_NODE_SSD_DIR") or None,
            device=environ.get("KCAAS_NODE_TORCH_DEVICE") or None,
            broker_transport_options=json.loads(environ.get("CELERY_BROKER_TRANSPORT_OPTIONS") or "null"),
            metrics_port=int(environ["KCAAS_NODE_METRICS_PORT"]) if environ.get("KCAAS_NODE_METRICS_PORT") else None,
            metrics_addr=environ.get("KCAAS_NODE_METRICS_ADDR") or "127.0.0.1",
            tls_cert_file=environ.get("KCAAS_NODE_TLS_CERT") or None,
            tls_key_file=environ.get("KCAAS_NODE_TLS_KEY") or None,
            listen=environ.get("KCAAS_NODE_LISTEN") or None,
            uds_path=environ.get("KCAAS_NODE_UDS") or None,
            migration_listen=environ.get("KCAAS_NODE_MIGRATION_LISTEN") or None,
            migration_endpoint=environ.get("KCAAS_NODE_MIGRATION_ENDPOINT") or None,
            migration_max_bytes_per_second=float(environ.get("KCAAS_NODE_MIGRATION_MAX_BYTES_PER_SECOND") or 0) or None,
            token_issuer=environ.get("KCAAS_TOKEN_ISSUER") or "kcaas-control-plane",
            drain_seconds=float(environ.get("KCAAS_NODE_DRAIN_SECONDS") or 20.0),
            tenant_limits=TenantLimits(
                max_connections=int(environ.get("KCAAS_NODE_TENANT_MAX_CONNECTIONS") or 64),
                max_inflight_requests=int(environ.get("KCAAS_NODE_TENANT_MAX_REQUESTS") or 8),
                max_inflight_bytes=int(environ.get("KCAAS_NODE_TENANT_MAX_INFLIGHT_BYTES") or 1 << 30),
            ),
            node_limits=NodeLimits(
                max_connections_per_source=int(environ.get("KCAAS_NODE_MAX_CONNECTIONS_PER_SOURCE") or 64),
                max_unauthenticated=int(environ.get("KCAAS_NODE_MAX_UNAUTHENTICATED") or 64),
                max_unauthenticated_per_source=int(environ.get("KCAAS_NODE_MAX_UNAUTHENTICATED_PER_SOURCE") or 8),
                hello_timeout=float(environ.get("KCAAS_NODE_HELLO_TIMEOUT") or 5.0),
                payload_stall_timeout=float(environ.get("KCAAS_NODE_PAYLOAD_STALL_TIMEOUT") or 10.0),
                max_staged_bytes=int(environ.get("KCAAS_NODE_MAX_STAGED_BYTES") or 4 << 30),
            ),
            usage_seconds=float(environ.get("KCAAS_NODE_USAGE_SECONDS") or 60.0),
            identity=_flag(environ.get("KCAAS_NODE_IDENTITY"), default=True),
            identity_dir=environ.get("KCAAS_NODE_IDENTITY_DIR") or None,
            tls_from_identity=_flag(environ.get("KCAAS_NODE_TLS_FROM_IDENTITY"), default=False),
            network_store_master=environ.get("KCAAS_NETWORK_STORE_MASTER") or None,
            network_store_metadata=environ.get("KCAAS_NETWORK_STORE_METADATA") or None,
            network_store_timeout=float(environ.get("KCAAS_NETWORK_STORE_TIMEOUT_S") or 1.0),
        )

    @property
    def capacity(self) -> dict[str, int]:
        return {"device": self.device_capacity_bytes, "dram": self.dram_capacity_bytes, "ssd": self.ssd_capacity_bytes}


def open_network_store(config: AgentConfig):
    """This node's client of the fleet's network store (a GuardedStore), or None when none is configured. The client
    connects on first use, on the guard's thread: a store that is down delays nothing (its tier answers misses)."""
    if not config.network_store_master or not config.network_store_metadata:
        return None
    from gpu_node.tiers.guarded_store import GuardedStore
    from gpu_node.tiers.object_store import MooncakeObjectStore

    client = MooncakeObjectStore(config.network_store_master, config.network_store_metadata)
    return GuardedStore(client, timeout_s=config.network_store_timeout)


def _flag(value: str | None, *, default: bool) -> bool:
    return default if not value else value.strip().lower() not in ("0", "false", "no", "off")


class ControlPlaneError(NodeError):
    """The control plane refused a request of this node: its HTTP `status` and error code (`api_code`)."""

    def __init__(self, status: int, api_code: str, message: str):
        super().__init__(f"{status} {api_code}: {message}")
        self.status, self.api_code = status, api_code


class ControlPlane:
    """The node's REST calls to the control plane, authenticated with the node credential (stdlib only)."""

    def __init__(self, base_url: str, credential: str, *, timeout: float = 10.0):
        self._base_url, self._credential, self._timeout = base_url, credential, timeout

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self._base_url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {self._credential}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            try:
                detail = json.loads(error.read())["error"]
            except (ValueError, KeyError, TypeError):
                detail = {"code": "http_error", "message": error.reason}
            raise ControlPlaneError(error.code, detail.get("code", ""), detail.get("message", "")) from None

    def register(
        self,
        *,
        endpoint: str,
        capacity: dict,
        caches: Sequence[str] = (),
        csr: str | None = None,
        sealing_public_key: str | None = None,
    ) -> dict:
        body = {"endpoint": endpoint, "capacity": capacity, "caches": list(caches)}
        if csr is not None:
            body["csr"] = csr
        if sealing_public_key is not None:
            body["sealing_public_key"] = sealing_public_key
        return self._post("/api/v1/nodes/register", body)

    def certificate(self, csr: str) -> dict:
        """A renewed node certificate from a fresh CSR: {"certificate", "ca_certificate"} (PEM)."""
        return self._post("/api/v1/nodes/certificate", {"csr": csr})

    def heartbeat(self, *, capacity: dict, resident: list[dict]) -> dict:
        return self._post("/api/v1/nodes/heartbeat", {"capacity": capacity, "resident": resident})

    def usage(self, report: dict) -> dict:
        """One usage report (gpu_node.agent.usage): idempotent on (node, boot_id, sequence)."""
        return self._post("/api/v1/nodes/usage", report)

    def jwks(self) -> dict:
        """The control plane's public data-token keys (GET /.well-known/jwks.json, unauthenticated)."""
        with urllib.request.urlopen(self._base_url + "/.well-known/jwks.json", timeout=self._timeout) as response:
            return json.loads(response.read())


class Heartbeat:
    """Renews the lease every `interval` seconds through `send`; a 409 reregister_required (the control plane
    declared the node lost) calls `reregister`. Given its timer and sender, so tests drive `tick()` directly."""

    def __init__(self, *, send, reregister, interval: float):
        self._send, self._reregister, self.interval = send, reregister, interval
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        try:
            self._send()
        except ControlPlaneError as error:
            if error.api_code == "reregister_required":
                self._reregister()
            else:
                logger.warning("heartbeat refused: %s", error)
        except OSError as error:  # the control plane is unreachable: keep serving, try again next tick
            logger.warning("heartbeat failed: %s", error)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kcaas-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.tick()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # a tick blocked on the control plane must not hold the exit (daemon thread)


class NodeAgent:
    def __init__(self, config: AgentConfig, *, control: ControlPlane | None = None):
        self.config = config
        self.control = control or ControlPlane(config.control_url, config.credential)
        self.registry: CacheRegistry | None = None
        self.node_id: str | None = None
        self._worker: Any = None  # celery's WorkController (untyped)
        self._worker_thread: threading.Thread | None = None
        self._heartbeat: Heartbeat | None = None
        self.usage_reporter: UsageReporter | None = None
        self._usage_loop: UsageReportLoop | None = None
        self.metrics: NodeMetrics | None = None
        self._metrics_server = None
        self.dataplane: DataPlaneServer | None = None  # once started
        self.revocations = RevocationList()
        self._migration_listener: MigrationListener | None = None  # when KCAAS_NODE_MIGRATION_LISTEN is set
        self.identity: NodeIdentity | None = None  # when config.identity
        self.sealing_key: NodeSealingKey | None = None  # opens the keys in this node's orders (held once started)
        self._renewal: RenewalLoop | None = None

    # ---- what `start` made (called before it: an AssertionError, a lifecycle step out of order) -----------------
    def _registry(self) -> CacheRegistry:
        assert self.registry is not None, "the registry is made by start()"
        return self.registry

    def _node_id(self) -> str:
        assert self.node_id is not None, "the node id comes with registration"
        return self.node_id

    def _sealing_key(self) -> NodeSealingKey:
        assert self.sealing_key is not None, "the sealing key is loaded by start()"
        return self.sealing_key

    # ---- steps ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        config = self.config
        self.registry = CacheRegistry(
            device_capacity_bytes=config.device_capacity_bytes,
            device=config.device,
            ssd_dir=config.ssd_dir,
            network_store=open_network_store(config),
        )
        self.metrics = NodeMetrics(self.registry, self.config.capacity)
        if config.metrics_port is not None:
            self._metrics_server, _ = self.metrics.serve(config.metrics_port, config.metrics_addr)
        self._load_identity()
        registration = self.register()
        self._start_worker()
        self._heartbeat = Heartbeat(
            send=self.send_heartbeat, reregister=self.register, interval=registration["heartbeat_interval_seconds"]
        )
        self._heartbeat.start()
        self.usage_reporter = UsageReporter(snapshot=self.registry.usage_snapshot, send=self.control.usage)
        self._usage_loop = UsageReportLoop(self.usage_reporter, config.usage_seconds)
        self._usage_loop.start()
        self._start_renewal()
        self._start_dataplane()
        logger.info("node %s serving %s", self.node_id, config.endpoint)

    def stop(self) -> None:
        steps = (
            ("data plane", self._stop_dataplane),
            ("migration listener", self._stop_migration_listener),
            ("heartbeat", self._stop_heartbeat),
            ("certificate renewal", self._stop_renewal),
            ("last report", self._report_once),
            ("usage reports", self._stop_usage_reports),
            ("worker", self._stop_worker),
            ("metrics", self._stop_metrics),
        )
        for name, step in steps:
            try:
                step()
            except Exception:
                logger.exception("error while stopping the %s", name)

    # ---- control plane --------------------------------------------------------------------------------------------
    def register(self) -> dict:
        """(Re-)register with what this process still holds (nothing after a restart: the control plane provisions
        those again). The answer names the caches whose blocks the node may keep (`stored_caches`): the SSD
        directories of all others are deleted (a cache detached, failed or moved away while the node was down)."""
        registration = self.control.register(
            endpoint=self.config.endpoint,
            capacity=self.config.capacity,
            caches=self._registry().cache_ids(),
            csr=self._register_csr(),
            sealing_public_key=self._sealing_key().public_key_b64,
        )
        self.node_id = registration["node"]["id"]
        self._install_certificate(registration)
        self.revocations.update(registration.get("revoked_tokens"))
        if registration.get("stored_caches") is not None:  # an older control plane does not say: keep everything
            removed = self._registry().remove_unplaced_directories(registration["stored_caches"])
            if removed:
                logger.info("deleted the SSD directories of %d caches no longer placed here", len(removed))
        return registration

    def send_heartbeat(self) -> dict:
        answer = self.control.heartbeat(capacity=self.config.capacity, resident=self._registry().resident_snapshot())
        self.revocations.update(answer.get("revoked_tokens"))
        if self.metrics is not None:
            self.metrics.node.heartbeat_succeeded()  # kcaas_node_heartbeat_age_seconds counts from here
        return answer

    def _report_once(self) -> None:
        """The last heartbeat before exiting: the control plane sees what the node held when it stopped serving."""
        if self._heartbeat is not None:
            self._heartbeat.tick()

    # ---- node identity (gpu_node/agent/identity.py)
    # ------------------------------------------------------------------------
    def _load_identity(self) -> None:
        """The node's certificate identity (when configured) and, always, its sealing key: the control plane seals
        the keys of provisioning and migration orders to the public half this node registers
        (kcaas/node_protocol/sealing.py).
        Kept in KCAAS_NODE_IDENTITY_DIR when set (0600), else fresh for this process."""
        from gpu_node.agent.identity import NodeIdentity, load_sealing_key
        from kcaas.node_protocol.sealing import NodeSealingKey

        if self.config.identity:
            self.identity = NodeIdentity.load(self.config.identity_dir) if self.config.identity_dir else NodeIdentity()
        self.sealing_key = load_sealing_key(self.config.identity_dir) if self.config.identity_dir else NodeSealingKey()

    def _register_csr(self) -> str | None:
        """A CSR for register: the current key first, a fresh key on re-registration (rotation)."""
        if self.identity is None:
            return None
        return (self.identity.renewal_csr_pem() if self.identity.has_certificate else self.identity.csr_pem()).decode()

    def _install_certificate(self, answer: dict) -> None:
        if self.identity is not None and answer.get("certificate"):
            self.identity.install(answer["certificate"], answer["ca_certificate"])
            self._save_identity()

    def _save_identity(self) -> None:
        if self.identity is not None and self.config.identity_dir:
            self.identity.save(self.config.identity_dir)

    def _start_renewal(self) -> None:
        if self.identity is not None and self.identity.has_certificate:
            from gpu_node.agent.identity import RenewalLoop

            renewal = RenewalLoop(self.identity, send=self.control.certificate, save=self._save_identity)
            self._renewal = renewal
            renewal.start()

    def _stop_migration_listener(self) -> None:
        if self._migration_listener is not None:
            self._migration_listener.stop()

    def _stop_renewal(self) -> None:
        if self._renewal is not None:
            self._renewal.stop()

    # ---- the in-process Celery worker -------------------------------------------------------------------------------
    def _migration(self):
        """The migration side (gpu_node/migration/tasks.py) when KCAAS_NODE_MIGRATION_LISTEN is set and the node holds
        a platform certificate: its listener requires the platform CA's client certificates. Other nodes are told
        to dial KCAAS_NODE_MIGRATION_ENDPOINT, else the data-plane endpoint's host at the listener's bound port (port
        0 in the listen address: any free port, still advertised right)."""
        if not self.config.migration_listen or self.identity is None or not self.identity.has_certificate:
            logger.warning(
                "no migration listener (KCAAS_NODE_MIGRATION_LISTEN and a node identity are needed): caches "
                "cannot be migrated to or from this node, so a drain of another node cannot move here"
            )
            return None
        from gpu_node.migration.tasks import NodeMigration
        from gpu_node.migration.transfer import MigrationListener

        host, _, port = self.config.migration_listen.rpartition(":")
        listener = MigrationListener(
            self.registry,
            self.identity.server_context(),
            host.strip("[]") or "0.0.0.0",
            int(port),
            metrics=self.metrics,
        ).start()
        self._migration_listener = listener
        advertise = (
            self.config.migration_endpoint or f"{self.config.endpoint.rpartition(':')[0]}:{listener.address[1]}"
        )  # the data plane's host
        logger.info("migration listener on %s:%s, advertised as %s", *listener.address[:2], advertise)
        return NodeMigration(
            registry=self.registry,
            node_id=self._node_id(),
            listener=listener,
            client_context=self.identity.client_context(),
            advertise=advertise,
            max_bytes_per_second=self.config.migration_max_bytes_per_second,
        )

    def _start_worker(self) -> None:
        app = build_node_app(
            broker_url=self.config.broker_url,
            node_id=self._node_id(),
            endpoint=self.config.endpoint,
            registry=self._registry(),
            transport_options=self.config.broker_transport_options,
            revocations=self.revocations,
            migration=self._migration(),
            sealing_key=self.sealing_key,
        )
        # A bare WorkController (not the `celery worker` program): no signal handlers of its own (they belong to
        # the main thread), a solo pool so tasks run in this process next to the pools they act on.
        worker = app.WorkController(
            app=app,
            queues=[node_queue(self._node_id())],
            pool_cls="solo",
            concurrency=1,
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
            use_eventloop=False,
            hostname=f"kcaas-node-{self.node_id}@localhost",
        )
        self._worker = worker

        def run() -> None:
            app.set_current()  # the consumer resolves tasks through the current app, which is per thread
            app.set_default()
            worker.start()

        self._worker_thread = threading.Thread(target=run, name="kcaas-worker", daemon=True)
        self._worker_thread.start()

    def _stop_worker(self) -> None:
        """Warm stop, from the worker's own thread: the consumer loop checks Celery's stop flag between broker reads
        (at most 2 s apart), finishes the task in hand, and shuts its connection down itself. (Calling
        WorkController.stop() from this thread would close the broker connection under the consumer's feet: the
        consumer then dies and the close can block forever on the half-read socket.) The wait is bounded:
        anything unacknowledged is redelivered (acks_late) and every handler is idempotent."""
        if self._worker is not None:
            from celery.worker import state as worker_state

            worker_state.should_stop = 0  # EX_OK: one worker per agent process, so the process-wide flag is ours
            thread = self._worker_thread
            assert thread is not None, "a worker runs on its thread"
            thread.join(timeout=WORKER_STOP_SECONDS)
            if thread.is_alive():
                logger.warning("the worker did not stop within %s s; exiting", WORKER_STOP_SECONDS)

    # ---- the data plane ---------------------------------------------------------------------------------------------
    def _start_dataplane(self) -> None:
        config = self.config
        from_identity = bool(
            config.tls_from_identity
            and self.identity is not None
            and self.identity.has_certificate
            and not (config.tls_cert_file and config.tls_key_file)
        )
        tls = bool(config.tls_cert_file and config.tls_key_file) or from_identity
        if not tls and not config.uds_path:
            logger.warning("no data plane: set KCAAS_NODE_TLS_CERT and KCAAS_NODE_TLS_KEY (and/or KCAAS_NODE_UDS)")
            return
        from gpu_node.dataplane.server import DataPlaneServer, TokenVerifier, server_tls_context

        verifier = TokenVerifier(
            self.control.jwks(), issuer=config.token_issuer, fetch_jwks=self.control.jwks, revocations=self.revocations
        )
        host = port = None
        if tls:
            host, _, port_text = (config.listen or config.endpoint).rpartition(":")
            host, port = host.strip("[]") or "0.0.0.0", int(port_text)
        cert_file, key_file = config.tls_cert_file, config.tls_key_file
        context = server_tls_context(cert_file, key_file) if cert_file and key_file and not from_identity else None
        if from_identity:
            assert self.identity is not None
            context = self.identity.dataplane_server_context()  # follows renewals; clients verify with the CA
        self.dataplane = DataPlaneServer(
            self._registry(),
            self._node_id(),
            verifier,
            context,
            host or "127.0.0.1",
            port or 0,
            uds_path=config.uds_path,
            metrics=self.metrics,
            tenant_limits=config.tenant_limits,
            node_limits=config.node_limits,
        ).start()

    def _stop_dataplane(self) -> None:
        if self.dataplane is not None:
            still_busy = self.dataplane.drain(self.config.drain_seconds)
            if still_busy:
                logger.warning(
                    "%d data-plane requests did not finish within %s s; cutting them",
                    still_busy,
                    self.config.drain_seconds,
                )
            self.dataplane.stop()

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    def _stop_usage_reports(self) -> None:
        """Stop the timer, then one last report (and a last try at the unsent ones): what the node served until it
        stopped serving is billed."""
        if self._usage_loop is not None:
            self._usage_loop.stop()
            if self.usage_reporter is not None:
                self.usage_reporter.tick()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()


def main() -> int:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    keep_block_buffers_on_heap()  # block-sized buffers reused from the heap, not faulted in per block
    faulthandler.register(
        signal.SIGUSR1
    )  # `kill -USR1 <pid>` prints every thread's stack: a stuck agent explains itself
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())  # handlers only set a flag
    agent = NodeAgent(AgentConfig.from_env())
    agent.start()
    print(f"kcaas node agent {agent.node_id} ready", flush=True)
    stop_requested.wait()
    logger.info("stopping")
    agent.stop()
    return 0
