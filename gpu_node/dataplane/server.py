"""The node's data-plane server: `kcaas.wire` frames over TLS 1.3 (TCP) and, optionally, a Unix domain socket.

This module handles connections: accept (within the node's connection limits), the TLS handshake, one thread per
connection, its deadlines, draining and closing. What each frame asks and is answered is the request handler's
(gpu_node/dataplane/requests.py): it checks a data request from its metadata, in the decoder's payload sink, before
any payload byte is read (a refused PUT never allocates its KV), verifies HELLO's data token and dispatches requests
to the cache's engine. Per connection:

- a `wire.FrameDecoder` bounded by `max_frame_bytes` / `max_metadata_bytes`, fed with `recv_into` (zero copy: a PUT's
  KV lands in the connection's staging buffer, viewed with `torch.frombuffer`, then written into the pool);
- requests are served one at a time (one in flight per connection; a client may pipeline, answers come in order):
  receive (`_receive`: wait within the connection's deadline, decode), then answer each complete frame (`_answer`);
- a slow peer is cut: `idle_timeout` between frames, `frame_timeout` to complete a frame once it started, and
  `handshake_timeout` for TLS (dataplane_conn.Deadlines). A stream error (garbage, oversized frame, truncation) is
  answered with ERROR (when the socket still works) and the connection is closed.

The engine writes a put's blocks and publishes them only when complete (PagedKVCache), so a connection that dies
mid-payload leaves nothing visible. Plaintext hygiene (gpu_node/dataplane/connection.py): every buffer a request's or an
answer's bytes passed through is zeroed after its use or when its connection closes, TLS record buffers are
cleansed by OpenSSL (dataplane_io.cleanse_plaintext), and purging a tenant from the registry closes the connections
that served it and zeroes their buffers before the purge answers (`purge_tenant`).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_node.agent.registry import CacheRegistry
from gpu_node.dataplane.admission import ConnectionGate, NodeLimits, TenantAdmission, TenantLimits
from gpu_node.dataplane.connection import Conn, Deadlines
from gpu_node.dataplane.io import (  # noqa: F401 - server_tls_context is part of this module's API
    bind_uds,
    close_quietly,
    hard_shutdown,
    harden_server_context,
    recv_into,
    send_buffers,
    send_quietly,
    server_tls_context,
    source_of,
    tune_socket,
    unlink_quietly,
)
from gpu_node.dataplane.requests import RequestHandler
from gpu_node.dataplane.staging import StagingPool
from gpu_node.dataplane.tokens import (
    TokenVerifier,  # also part of this module's API (the agent and tests import it here)
)
from kcaas import wire
from kcaas.wire import ProtocolError

log = logging.getLogger(__name__)

MAX_FAILED_HELLOS = 8  # per connection: then it is closed (token guessing costs a reconnect + handshake)
DEFAULT_MAX_ANSWER_BYTES = 64 << 30  # a GET answered from a host pool: 512K tokens of Llama-3-8B in one frame
PURGE_CLOSE_SECONDS = 5.0  # a purge waits this long for each closed connection's thread to zero its buffers


class DataPlaneServer:
    def __init__(
        self,
        registry: CacheRegistry,
        node_id: str,
        verifier: TokenVerifier,
        tls_context: ssl.SSLContext | None,
        host: str = "127.0.0.1",
        port: int = 0,
        uds_path: str | None = None,
        *,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        max_metadata_bytes: int = wire.DEFAULT_MAX_METADATA_BYTES,
        max_connections: int = 256,
        idle_timeout: float = 300.0,
        frame_timeout: float = 30.0,
        handshake_timeout: float = 10.0,
        metrics: Any = None,
        tenant_limits: TenantLimits | None = None,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        node_limits: NodeLimits | None = None,
    ):
        """`metrics`: an optional gpu_node.agent.metrics.NodeMetrics (request latency per op, TLS handshakes by outcome,
        refused tokens by reason, refusals by admission limit). `tenant_limits`: per-tenant connections, requests
        in flight and staged bytes (gpu_node.dataplane.admission). `max_answer_bytes`: a GET answered straight from a
        host pool (nothing staged) may go in one frame this large to a client that offers to take it at HELLO, so a long
        prompt's KV is one answer, not one per max_frame_bytes. `node_limits`: what holds before a tenant is known
        (connections per source, unauthenticated connections, the HELLO deadline, a stalled payload) and the
        node-wide staging budget (gpu_node.dataplane.admission.NodeLimits)."""
        if tls_context is None and host is not None:
            raise ValueError("a TCP listener needs a TLS context (plain TCP is never served)")
        if tls_context is not None:
            harden_server_context(tls_context)  # whoever built it: TLS 1.3 only, no plaintext left in OpenSSL
        self.registry = registry
        self.node_id = str(node_id)
        self.verifier = verifier
        self.tls_context = tls_context
        self.host, self.port, self.uds_path = host, port, uds_path
        self.max_frame_bytes = max_frame_bytes
        self.max_metadata_bytes = max_metadata_bytes
        self.max_answer_bytes = max(max_answer_bytes, max_frame_bytes)
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self.handshake_timeout = handshake_timeout
        self.metrics = metrics
        self.admission = TenantAdmission(tenant_limits, on_refusal=self._count_refusal)
        self.node_limits = node_limits or NodeLimits()
        self.deadlines = Deadlines(idle_timeout, frame_timeout, self.node_limits)
        self.gate = ConnectionGate(self.node_limits, on_refusal=self._count_refusal)
        staged_bytes = max(self.node_limits.max_staged_bytes, max_frame_bytes)
        self.staging = StagingPool(staged_bytes, on_refusal=self._count_refusal)
        self.requests = RequestHandler(
            registry,
            self.node_id,
            verifier,
            admission=self.admission,
            gate=self.gate,
            staging=self.staging,
            metrics=metrics,
            max_frame_bytes=max_frame_bytes,
            max_metadata_bytes=max_metadata_bytes,
            max_answer_bytes=self.max_answer_bytes,
        )
        self._draining = False
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()
        self._listeners: list[socket.socket] = []
        self._accept_threads: list[threading.Thread] = []
        self._stopping = threading.Event()  # connections: leave now
        self._accepting = threading.Event()  # accept loops: go on while set
        self.address: tuple[str, int] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> DataPlaneServer:
        self._stopping.clear()
        self._accepting.set()
        self._draining = False
        self.registry.add_purge_listener(self.purge_tenant)
        self.verifier.revocations.add_listener(self._cut_revoked)
        if self.host is not None:
            tcp = socket.create_server((self.host, self.port), backlog=128, reuse_port=False)
            self.address = tcp.getsockname()[:2]
            self._listen(tcp, tls=True)
        if self.uds_path:
            self._listen(bind_uds(self.uds_path), tls=False)
        return self

    @property
    def endpoint(self) -> str:
        assert self.address is not None, "not started"
        return f"{self.address[0]}:{self.address[1]}"

    def _listen(self, listener: socket.socket, *, tls: bool) -> None:
        listener.settimeout(0.2)  # the accept loop polls the stop flag
        self._listeners.append(listener)
        name = f"dataplane-accept-{'tls' if tls else 'uds'}"
        thread = threading.Thread(target=self._accept_loop, args=(listener, tls), daemon=True, name=name)
        self._accept_threads.append(thread)
        thread.start()

    def _close_listeners(self, timeout: float) -> None:
        self._accepting.clear()
        for listener in self._listeners:
            close_quietly(listener)
        for thread in self._accept_threads:
            thread.join(timeout)

    def drain(self, timeout: float = 10.0) -> int:
        """Graceful stop, first half: accept nothing new, close idle connections, and let every request that has
        started arriving finish and be answered (then its connection closes). Returns how many connections were
        still busy at the deadline; `stop()` cuts those."""
        with self._lock:
            self._draining = True
        self._close_listeners(timeout)
        deadline = time.monotonic() + timeout
        while True:
            self._cut(lambda conn: not conn.busy and not conn.closing)
            with self._lock:
                busy = sum(1 for conn in self._conns if conn.busy)
            if busy == 0 or time.monotonic() >= deadline:
                return busy
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listeners, then every connection (in-flight requests are cut), and join the threads."""
        self._stopping.set()
        self._close_listeners(timeout)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            hard_shutdown(conn.sock)
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(timeout)
        self.registry.remove_purge_listener(self.purge_tenant)
        self.verifier.revocations.remove_listener(self._cut_revoked)
        self.staging.close()
        self._listeners.clear()
        self._accept_threads.clear()
        if self.uds_path:
            unlink_quietly(self.uds_path)

    def __enter__(self) -> DataPlaneServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def revoke(self, jti: str) -> None:
        """Refuse this token from now on, on new HELLOs and on connections already authenticated with it."""
        self.verifier.revoke(jti)

    def connection_count(self) -> int:
        with self._lock:
            return len(self._conns)

    # ---- closing connections from outside ---------------------------------------------------------------------
    def _cut(self, which: Callable[[Conn], bool]) -> list[Conn]:
        """Close the connections `which` picks now; each one's thread zeroes its buffers on its way out."""
        with self._lock:
            conns = [conn for conn in self._conns if which(conn)]
            for conn in conns:
                conn.closing = True
        for conn in conns:
            hard_shutdown(conn.sock)
        return conns

    def purge_tenant(self, tenant_id: str, timeout: float = PURGE_CLOSE_SECONDS) -> int:
        """Erasure (called by CacheRegistry.purge_tenant once the tenant's caches are no longer hosted): close every
        connection that served the tenant and wait until each has zeroed its buffers (its thread does, on the way
        out); one still running after `timeout` is zeroed from here. Returns how many connections were closed."""
        conns = self._cut(lambda conn: conn.serves_tenant(tenant_id))
        deadline = time.monotonic() + timeout
        for conn in conns:
            if conn.thread is not None and conn.thread is not threading.current_thread():
                conn.thread.join(max(deadline - time.monotonic(), 0.0))
            if conn.thread is None or conn.thread.is_alive():
                log.warning("a purged tenant's connection did not close in %s s: zeroing its buffers anyway", timeout)
                conn.scrub()
        self._scrub_staging({tenant_id, f"tenant:{tenant_id}"})
        return len(conns)

    def _scrub_staging(self, tenants) -> None:
        for tenant in tenants:
            self.staging.scrub_tenant(str(tenant))

    def _cut_revoked(self, jtis: set[str]) -> None:
        """Revoked tokens (pushed, or listed in a heartbeat): connections with a session opened by one are cut now,
        not at their next request (a suspended tenant's, or a revoked key's, engines lose the data plane at once)."""
        self._cut(lambda conn: conn.uses_any_token(jtis))

    # ---- accepting ----------------------------------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket, tls: bool) -> None:
        while self._accepting.is_set():
            try:
                raw, addr = listener.accept()
            except TimeoutError:
                self.staging.trim()  # idle staging past its time goes back to the system
                continue
            except OSError:
                return  # closed by stop()
            conn = self._admit(raw, addr)
            if conn is not None:
                conn.thread = threading.Thread(target=self._serve, args=(conn, tls), daemon=True, name="dataplane-conn")
                conn.thread.start()

    def _admit(self, raw: socket.socket, addr) -> Conn | None:
        """The accepted socket as a connection to serve, or None (closed) when over a connection limit: node-wide,
        from its source, or of connections not yet authenticated."""
        raw.setblocking(True)
        source = source_of(raw, addr)
        conn = Conn(raw, str(addr) if addr else "uds", source=source, accepted_at=time.monotonic())
        with self._lock:
            full = len(self._conns) >= self.max_connections
        if full or not self.gate.admit(source):
            close_quietly(raw)
            if full:
                self._count_refusal("connections")
            return None
        with self._lock:
            self._conns.add(conn)
        return conn

    # ---- one connection -----------------------------------------------------------------------------------------
    def _serve(self, conn: Conn, tls: bool) -> None:
        try:
            if tls and not self._handshake(conn):
                return
            tune_socket(conn.sock)
            self._loop(conn)
        except Exception:  # never let a connection thread die noisily; the peer gets a closed stream
            log.exception("data-plane connection failed")
        finally:
            self._closed(conn)

    def _handshake(self, conn: Conn) -> bool:
        """TLS, within the handshake deadline (and the HELLO one): False when it failed (wrong protocol version, no
        shared cipher, timeout)."""
        conn.sock.settimeout(min(self.handshake_timeout, self.node_limits.hello_timeout))
        try:
            conn.sock = self.tls_context.wrap_socket(conn.sock, server_side=True)
        except (OSError, ssl.SSLError):
            self._count_handshake("failed")
            return False
        self._count_handshake("ok")
        return True

    def _closed(self, conn: Conn) -> None:
        """The connection's thread is leaving: give back what it held, close it, zero its buffers."""
        with self._lock:
            self._conns.discard(conn)
        self.gate.closed(conn.source, authenticated=conn.authenticated)
        tenants = self.requests.release(conn)
        close_quietly(conn.sock)
        conn.scrub()  # last: nothing of what this connection carried stays in its buffers
        self._scrub_staging(tenants)  # nor in the staging it gave back

    def _count_refusal(self, limit: str) -> None:
        if self.metrics is not None:
            self.metrics.overloaded.labels(limit=limit).inc()

    def _count_handshake(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.tls_handshakes.labels(outcome=outcome).inc()

    def _loop(self, conn: Conn) -> None:
        """Receive, then answer every frame that is complete, until the connection is to close."""
        decoder = wire.FrameDecoder(
            max_frame_bytes=self.max_frame_bytes,
            max_metadata_bytes=self.max_metadata_bytes,
            payload_sink=lambda head: self.requests.sink(conn, head),
        )
        conn.scratch = decoder.get_buffer()  # outside a payload: the decoder's one read buffer, zeroed at close
        while not self._stopping.is_set():
            if not self._receive(conn, decoder):
                return
            for frame in decoder.frames():
                if not self._answer(conn, frame):
                    return
            if not self._settle(conn, decoder):
                return

    # ---- receiving ----------------------------------------------------------------------------------------------
    def _receive(self, conn: Conn, decoder: wire.FrameDecoder) -> bool:
        """Wait for bytes within the connection's deadline and decode them. False: close (a deadline passed, the
        peer left or broke the stream, or drain closed this idle connection)."""
        if not self.deadlines.arm(conn, decoder.in_frame):
            return False  # no HELLO in time, or a frame that does not complete in time
        try:
            n = recv_into(conn.sock, decoder.get_buffer(), fill=decoder.buffer_is_payload)
        except (OSError, ssl.SSLError):  # a timeout too: idle too long, stalled inside a frame, or no HELLO in time
            return False
        with self._lock:
            if conn.closing:
                return False  # drain closed this connection while it was idle
            conn.busy = True
        try:
            if n == 0:
                decoder.eof()  # TRUNCATED_FRAME if the peer left inside a frame
                return False
            decoder.buffer_updated(n)
        except ProtocolError as exc:  # the stream is bad: say why (if the socket still works), then close
            send_quietly(conn.sock, wire.encode_error_for(exc, exc.request_id))
            return False
        return True

    # ---- answering ----------------------------------------------------------------------------------------------
    def _handle(self, conn: Conn, frame: wire.Frame) -> list:
        """A decoded frame's answer (the request handler's); raises what RequestHandler.error_answer answers."""
        return self.requests.handle(conn, frame)

    def _answer(self, conn: Conn, frame: wire.Frame) -> bool:
        """Handle one frame and send its answer. False: close (the answer could not be sent, or too many HELLOs
        failed on this connection)."""
        started = time.perf_counter()
        try:
            response = self._handle(conn, frame)
        except Exception as exc:  # noqa: BLE001 - every failure of a request is answered (its code, else internal)
            response = self.requests.error_answer(frame, exc)
        sent = False
        try:
            send_buffers(conn.sock, response)
            sent = True
        except (OSError, ssl.SSLError):
            pass  # the peer is gone: close
        finally:
            self.requests.answered(conn, frame, started, sent=sent)
        return sent and conn.failed_hellos <= MAX_FAILED_HELLOS

    def _settle(self, conn: Conn, decoder: wire.FrameDecoder) -> bool:
        """After the frames of one read: the connection is busy while a frame is partly in; False when draining
        and it is not (its requests are answered: close it)."""
        with self._lock:
            conn.busy = decoder.in_frame
            return not (self._draining and not conn.busy)
