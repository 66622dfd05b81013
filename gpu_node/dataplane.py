"""The node's data-plane server: `kcaas.wire` frames over TLS 1.3 (TCP) and, optionally, a Unix domain socket.

One thread per connection (plus one accept thread per listener). Per connection:

- a `wire.FrameDecoder` bounded by `max_frame_bytes` / `max_metadata_bytes`, fed with `recv_into` (zero copy: a PUT's
  KV lands in the connection's staging buffer, viewed with `torch.frombuffer`, then written into the pool);
- HELLO carries a data token, verified offline by `TokenVerifier` (EdDSA only, iss, exp/nbf, jti revocation), then
  matched against the cache it names: audience `cache:<id>`, a cache this node hosts, the `node` claim == this node,
  the `epoch` claim == the hosted epoch. Every mismatch there answers the same `not_found`, so a token for one cache
  cannot learn whether another cache (another tenant's) exists on this node;
- data requests (LOOKUP/PUT/GET/DELETE and their batch forms) are checked in the decoder's payload sink, before any
  payload byte is read: a session for the cache, the token still valid and unrevoked, `access == "readwrite"` for
  put/delete, and the request's identity equal to the cache's. A refused request's payload is discarded, so a
  refused PUT never allocates its KV and never touches the cache;
- requests are served one at a time (one in flight per connection; a client may pipeline, answers come in order);
- a slow peer is cut: `idle_timeout` between frames, `frame_timeout` to complete a frame once it started, and
  `handshake_timeout` for TLS. A stream error (garbage, oversized frame, truncation) is answered with ERROR (when the
  socket still works) and the connection is closed.

The engine writes a put's blocks and publishes them only when complete (PagedKVCache), so a connection that dies
mid-payload leaves nothing visible: the put never reaches the engine.

Plaintext hygiene (gpu_node/dataplane_conn.py): every buffer a request's or an answer's bytes passed through is
zeroed after its use or when its connection closes, TLS record buffers are cleansed by OpenSSL
(dataplane_io.cleanse_plaintext), and purging a tenant from the registry closes the connections that served it and
zeroes their buffers before the purge answers (`purge_tenant`): an erased tenant's KV is left in no freed buffer.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import threading
import time
from typing import Any

import numpy as np

from gpu_node.admission import ConnectionGate, NodeLimits, TenantAdmission, TenantLimits
from gpu_node.dataplane_conn import Conn as _Conn, Session as _Session
from gpu_node.dataplane_io import (  # noqa: F401 - server_tls_context is part of this module's API
    cleanse_plaintext,
    close_quietly,
    hard_shutdown,
    recv_into,
    send_buffers,
    server_tls_context,
)
from gpu_node.engine_tiers import CachePurged
from gpu_node.dataplane_ops import answer_get, answer_put, count_served, release_prefixes
from gpu_node.registry import CacheRegistry
from gpu_node.migration_fence import MovedError, fences_for
from gpu_node.staging import StagingPool
from gpu_node.tokens import TokenVerifier
from kcaas import wire
from kcaas.spec import IdentityMismatch
from kcaas.wire import ErrorCode, Opcode, ProtocolError

log = logging.getLogger(__name__)

UDS_SEND_BUFFER_BYTES = 4 << 20
NOT_FOUND_MESSAGE = "no such cache on this node, or the token does not grant it"
WRITE_OPS = frozenset({"put", "delete"})
AUTH_FAILURE_CODES = frozenset({ErrorCode.UNAUTHENTICATED, ErrorCode.TOKEN_EXPIRED, ErrorCode.FORBIDDEN,
                                ErrorCode.NOT_FOUND})  # fmt: skip
MAX_FAILED_HELLOS = 8  # per connection: then it is closed (token guessing costs a reconnect + handshake)
DEFAULT_MAX_ANSWER_BYTES = 64 << 30  # a GET answered from a host pool: 512K tokens of Llama-3-8B in one frame
PURGE_CLOSE_SECONDS = 5.0  # a purge waits this long for each closed connection's thread to zero its buffers


# ---- server -------------------------------------------------------------------------------------------------------
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
        """`metrics`: an optional gpu_node.metrics.NodeMetrics (request latency per op, TLS handshakes by outcome,
        refused tokens by reason, refusals by admission limit). `tenant_limits`: per-tenant connections, requests
        in flight and staged bytes (gpu_node.admission). `max_answer_bytes`: a GET answered straight from a host
        pool (nothing staged) may go in one frame this large to a client that offers to take it at HELLO, so a long
        prompt's KV is one answer, not one per max_frame_bytes. `node_limits`: what holds before a tenant is known
        (connections per source, unauthenticated connections, the HELLO deadline, a stalled payload) and the
        node-wide staging budget (gpu_node.admission.NodeLimits)."""
        if tls_context is None and host is not None:
            raise ValueError("a TCP listener needs a TLS context (plain TCP is never served)")
        if tls_context is not None and tls_context.minimum_version < ssl.TLSVersion.TLSv1_3:
            tls_context.minimum_version = ssl.TLSVersion.TLSv1_3  # TLS 1.3 only, whatever the caller built
        if tls_context is not None:
            cleanse_plaintext(tls_context)  # whoever built it: no decrypted record left in OpenSSL's buffers
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
        self.gate = ConnectionGate(self.node_limits, on_refusal=self._count_refusal)
        self.staging = StagingPool(max(self.node_limits.max_staged_bytes, max_frame_bytes),
                                   on_refusal=self._count_refusal)  # fmt: skip
        self._draining = False
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
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
            try:
                os.unlink(self.uds_path)
            except FileNotFoundError:
                pass
            uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            uds.bind(self.uds_path)
            os.chmod(self.uds_path, 0o660)  # same-host engines of this node's group only; tokens still required
            uds.listen(128)
            self._listen(uds, tls=False)
        return self

    @property
    def endpoint(self) -> str:
        assert self.address is not None, "not started"
        return f"{self.address[0]}:{self.address[1]}"

    def _listen(self, listener: socket.socket, *, tls: bool) -> None:
        listener.settimeout(0.2)  # the accept loop polls the stop flag
        self._listeners.append(listener)
        thread = threading.Thread(target=self._accept_loop, args=(listener, tls), daemon=True,
                                  name=f"dataplane-accept-{'tls' if tls else 'uds'}")  # fmt: skip
        self._accept_threads.append(thread)
        thread.start()

    def _close_listeners(self, timeout: float) -> None:
        self._accepting.clear()
        for listener in self._listeners:
            try:
                listener.close()
            except OSError:
                pass
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
            with self._lock:
                idle = [c for c in self._conns if not c.busy and not c.closing]
                for conn in idle:
                    conn.closing = True
                busy = sum(1 for c in self._conns if c.busy)
            for conn in idle:
                hard_shutdown(conn.sock)
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
            try:
                os.unlink(self.uds_path)
            except FileNotFoundError:
                pass

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

    def purge_tenant(self, tenant_id: str, timeout: float = PURGE_CLOSE_SECONDS) -> int:
        """Erasure (called by CacheRegistry.purge_tenant once the tenant's caches are no longer hosted): close every
        connection that served the tenant and wait until each has zeroed its buffers (its thread does, on the way
        out); one still running after `timeout` is zeroed from here. Returns how many connections were closed."""
        with self._lock:
            conns = [conn for conn in self._conns if conn.serves_tenant(tenant_id)]
            for conn in conns:
                conn.closing = True
        for conn in conns:
            hard_shutdown(conn.sock)
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
        with self._lock:
            cut = [conn for conn in self._conns if conn.uses_any_token(jtis)]
            for conn in cut:
                conn.closing = True
        for conn in cut:
            hard_shutdown(conn.sock)

    def _accept_loop(self, listener: socket.socket, tls: bool) -> None:
        while self._accepting.is_set():
            try:
                raw, addr = listener.accept()
            except TimeoutError:
                self.staging.trim()  # idle staging past its time goes back to the system
                continue
            except OSError:
                return  # closed by stop()
            raw.setblocking(True)
            source = _source_of(raw, addr)
            conn = _Conn(raw, str(addr) if addr else "uds", source=source, accepted_at=time.monotonic())
            with self._lock:
                full = len(self._conns) >= self.max_connections
            if full or not self.gate.admit(source):
                close_quietly(raw)  # too many connections (node-wide, from this source, or not yet authenticated)
                if full:
                    self._count_refusal("connections")
                continue
            with self._lock:
                self._conns.add(conn)
            conn.thread = threading.Thread(target=self._serve, args=(conn, tls), daemon=True, name="dataplane-conn")
            conn.thread.start()

    # ---- one connection -----------------------------------------------------------------------------------------
    def _serve(self, conn: _Conn, tls: bool) -> None:
        try:
            if tls:
                conn.sock.settimeout(min(self.handshake_timeout, self.node_limits.hello_timeout))
                try:
                    conn.sock = self.tls_context.wrap_socket(conn.sock, server_side=True)
                except (OSError, ssl.SSLError):
                    self._count_handshake("failed")
                    return  # handshake failed (wrong protocol version, no shared cipher, timeout)
                self._count_handshake("ok")
            if conn.sock.family in (socket.AF_INET, socket.AF_INET6):
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:  # a Unix socket: a larger send buffer means fewer, larger copies per GET answer (capped by wmem_max)
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UDS_SEND_BUFFER_BYTES)
            self._loop(conn)
        except Exception:  # never let a connection thread die noisily; the peer gets a closed stream
            log.exception("data-plane connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            self.gate.closed(conn.source, authenticated=conn.authenticated)
            for hold in conn.holds.values():
                hold.release()
            release_prefixes(conn)
            for tenant in conn.tenants:
                self.admission.disconnect(tenant)
            conn.holds.clear()
            tenants, conn.tenants = set(conn.tenants), set()
            close_quietly(conn.sock)
            conn.scrub()  # last: nothing of what this connection carried stays in its buffers
            self._scrub_staging(tenants)  # nor in the staging it gave back

    def _count_refusal(self, limit: str) -> None:
        if self.metrics is not None:
            self.metrics.overloaded.labels(limit=limit).inc()

    def _count_handshake(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.tls_handshakes.labels(outcome=outcome).inc()

    def _loop(self, conn: _Conn) -> None:
        decoder = wire.FrameDecoder(max_frame_bytes=self.max_frame_bytes, max_metadata_bytes=self.max_metadata_bytes,
                                    payload_sink=lambda head: self._sink(conn, head))  # fmt: skip
        conn.scratch = decoder.get_buffer()  # outside a payload: the decoder's one read buffer, zeroed at close
        sock = conn.sock
        frame_started: float | None = None
        timeout = None  # the socket's, set only when it changes (each settimeout is a syscall)
        while not self._stopping.is_set():
            if decoder.in_frame and frame_started is None:
                frame_started = time.monotonic()
            elif not decoder.in_frame:
                frame_started = None
            wanted = self._read_timeout(conn, frame_started)
            if wanted is None:
                return  # a deadline passed: no HELLO in time, or a frame that does not complete in time
            if wanted != timeout:
                timeout = wanted
                sock.settimeout(timeout)
            try:
                buf = decoder.get_buffer()
                n = recv_into(sock, buf, fill=decoder.buffer_is_payload)
            except (TimeoutError, socket.timeout):
                return  # idle too long, stalled inside a frame, or no HELLO in time: close
            except (OSError, ssl.SSLError):
                return
            with self._lock:
                if conn.closing:
                    return  # drain closed this connection while it was idle
                conn.busy = True
            try:
                if n == 0:
                    decoder.eof()
                    return
                decoder.buffer_updated(n)
            except ProtocolError as exc:
                self._send_quietly(sock, wire.encode_error_for(exc, exc.request_id))
                return
            for frame in decoder.frames():
                started = time.perf_counter()
                try:
                    response = self._handle(conn, frame)
                except MovedError as exc:  # the cache is leaving or has left this node (gpu_node/migration_fence.py)
                    response = wire.encode_moved(frame.request_id, cache_id=exc.cache_id, endpoint=exc.endpoint,
                                                 epoch=exc.epoch)  # fmt: skip
                except CachePurged:  # purged (erasure) while this request was being served: gone, never zeros
                    response = wire.encode_error(frame.request_id, ErrorCode.NOT_FOUND, NOT_FOUND_MESSAGE)
                except ProtocolError as exc:
                    if exc.code in AUTH_FAILURE_CODES and self.metrics is not None:
                        self.metrics.auth_failures.labels(reason=exc.code).inc()
                    response = wire.encode_error_for(exc, frame.request_id)
                except Exception:
                    log.exception("data-plane request failed")
                    response = wire.encode_error(frame.request_id, ErrorCode.INTERNAL, "internal error")
                try:
                    send_buffers(sock, response)
                    count_served(conn)
                except (OSError, ssl.SSLError):
                    return
                finally:
                    self._frame_done(conn, frame)
                if self.metrics is not None:
                    op = wire.OP_NAMES.get(wire.Opcode(frame.opcode & ~wire.BATCH_BIT))
                    if op is not None:
                        self.metrics.request_seconds.labels(op=op).observe(time.perf_counter() - started)
                if conn.failed_hellos > MAX_FAILED_HELLOS:
                    return
            with self._lock:
                conn.busy = decoder.in_frame
                if self._draining and not conn.busy:
                    return  # draining: this connection's requests are answered; close it

    def _read_timeout(self, conn: _Conn, frame_started: float | None) -> float | None:
        """How long the next read may wait, or None when a deadline has passed: between frames idle_timeout;
        inside one the rest of frame_timeout, and at most payload_stall_timeout without a byte; before the first
        good HELLO, never past hello_timeout from accept (a connection that never authenticates holds nothing long)."""
        now, limits = time.monotonic(), self.node_limits
        if frame_started is None:
            wait = self.idle_timeout
        else:
            wait = min(frame_started + self.frame_timeout - now, limits.payload_stall_timeout)
        if not conn.authenticated:
            wait = min(wait, conn.accepted_at + limits.hello_timeout - now)
        if wait <= 0:
            return None
        return wait if frame_started is not None or not conn.authenticated else self.idle_timeout

    # ---- checks before the payload --------------------------------------------------------------------------------
    def _sink(self, conn: _Conn, head: wire.FrameHead) -> Any:
        """Decide on a frame's payload from its metadata: refuse (ProtocolError -> discarded) or give buffers."""
        if head.opcode not in wire.DATA_OPS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{head.opcode.name} is not a request")
        try:
            request = self._request_head(conn, head)
            self._authorize(conn, request)
            conn.request_heads[id(head.meta)] = request  # _handle takes it: parsed once per frame
        except ProtocolError:
            raise
        except IdentityMismatch as exc:
            fields = {k: list(v) for k, v in exc.fields.items()}
            raise ProtocolError(ErrorCode.IDENTITY_MISMATCH, str(exc), details={"fields": fields}) from None
        except Exception:
            log.exception("data-plane payload sink failed")
            raise ProtocolError(ErrorCode.INTERNAL, "internal error") from None
        kv_total = sum(request.kv_bytes) if request.carries_kv else 0
        tenant = self._tenant_of(conn, request)
        conn.holds[id(head.meta)] = self.admission.admit(tenant, kv_total)  # the tenant's budget, then the node's
        if not request.carries_kv:
            return None  # token ids only: small, the decoder buffers them
        return conn.put_buffers(id(head.meta), request.token_bytes, self.staging.lease(kv_total, tenant))

    def _request_head(self, conn: _Conn, head) -> wire.RequestHead:
        """The request's metadata, validated; a request without identity takes its session's (checked at HELLO)."""
        session = conn.sessions.get(head.meta.get("cache_id"))
        if session is None:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "send HELLO with a data token for this cache first")
        return wire.parse_request_head(head, session.identity)

    def _tenant_of(self, conn: _Conn, request: wire.RequestHead) -> str:
        return str(conn.sessions[request.cache_id].claims["sub"])

    def _frame_done(self, conn: _Conn, frame: wire.Frame) -> None:
        """The frame is answered: give back its admission and, if it was the one using it, the put staging; zero
        the buffers its request and answer went through (Conn.frame_done)."""
        hold = conn.holds.pop(id(frame.meta), None)
        if hold is not None:
            hold.release()
        conn.request_heads.pop(id(frame.meta), None)
        release_prefixes(conn)
        conn.served = None
        conn.frame_done(id(frame.meta), frame.payload)

    def _authorize(self, conn: _Conn, request: wire.RequestHead) -> _Session:
        session = conn.sessions.get(request.cache_id)
        if session is None:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "send HELLO with a data token for this cache first")
        fences_for(self.registry).check(request.cache_id, write=request.op in WRITE_OPS)
        hosted = self.registry.get(request.cache_id)
        if hosted is None or hosted.epoch != session.hosted.epoch:
            conn.sessions.pop(request.cache_id, None)
            raise ProtocolError(ErrorCode.NOT_FOUND, NOT_FOUND_MESSAGE)
        claims = session.claims
        if time.time() >= float(claims["exp"]) + self.verifier.leeway:
            raise ProtocolError(ErrorCode.TOKEN_EXPIRED, "the data token has expired: send HELLO with a fresh one")
        if self.verifier.is_revoked(claims["jti"]):
            conn.sessions.pop(request.cache_id, None)
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "the data token has been revoked")
        if request.op in WRITE_OPS and claims.get("access") != "readwrite":
            raise ProtocolError(ErrorCode.FORBIDDEN, f"a read-only token cannot {request.op}")
        if request.identity_sent:  # else the session's, checked against this cache at HELLO
            hosted.spec.check_matches(request.identity)
        return session

    # ---- requests ---------------------------------------------------------------------------------------------------
    def _handle(self, conn: _Conn, frame: wire.Frame) -> list:
        if frame.error is not None:
            raise frame.error
        if frame.opcode == Opcode.HELLO:
            return self._hello(conn, frame)
        if frame.opcode not in wire.DATA_OPS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{frame.opcode.name} is not a request")
        request_head = conn.request_heads.pop(id(frame.meta), None) or self._request_head(conn, frame)
        session = self._authorize(conn, request_head)  # again: time passed since the sink, or it was skipped
        if id(frame.meta) not in conn.holds:  # no payload: admitted here, released by _frame_done
            conn.holds[id(frame.meta)] = self.admission.admit(str(session.claims["sub"]))
        request = wire.parse_request(frame, request_head)
        engine = session.hosted.engine
        op, rid = request_head.op, frame.request_id
        tokens = [np.frombuffer(t, dtype=np.int32) for t in request.token_ids]
        if op == "lookup":
            return wire.encode_lookup_ok(rid, [engine.lookup(t) for t in tokens])
        if op in WRITE_OPS:  # counted, so a migration's fence waits for it (or refused with MOVED)
            with fences_for(self.registry).writing(request_head.cache_id):
                if op == "delete":
                    return wire.encode_delete_ok(rid, [engine.delete(t) for t in tokens])
                return answer_put(session.hosted, request, tokens)
        answer_limit = self.max_frame_bytes
        if session.max_answer_bytes is not None and engine.zero_copy_reads:  # nothing staged: one frame for it all
            answer_limit = max(session.max_answer_bytes, self.max_frame_bytes)
        return answer_get(conn, session.hosted, request, tokens, conn.holds[id(frame.meta)], answer_limit)

    def _hello(self, conn: _Conn, frame: wire.Frame) -> list:
        hello = wire.parse_hello(frame)
        try:
            claims = self.verifier.verify(hello.token)
            hosted = self.registry.get(hello.cache_id)
            moved = fences_for(self.registry).is_moved(hello.cache_id)
            if moved is not None and claims.get("aud") == f"cache:{hello.cache_id}":
                raise MovedError(hello.cache_id, *moved)  # a token for this cache: tell it where the cache went
            # One answer for every "this token does not open that cache here": unknown cache, another tenant's cache,
            # a token for another node or an older placement (epoch).
            if (
                hosted is None
                or claims.get("aud") != f"cache:{hello.cache_id}"
                or str(claims.get("node")) != self.node_id
                or claims.get("epoch") != hosted.epoch
            ):
                raise ProtocolError(ErrorCode.NOT_FOUND, NOT_FOUND_MESSAGE)
            if hello.identity is not None:  # checked once here: the session's requests may then leave it out
                self._check_identity(hosted, hello.identity)
        except ProtocolError:
            conn.failed_hellos += 1
            conn.sessions.pop(hello.cache_id, None)  # a failed re-HELLO drops the old session too
            raise
        tenant = str(claims["sub"])
        if not conn.authenticated:  # no longer counted against the node's unauthenticated budget
            conn.authenticated = True
            self.gate.authenticated(conn.source)
        if tenant not in conn.tenants:
            self.admission.connect(tenant)  # overloaded: the tenant holds its limit of connections on this node
            conn.tenants.add(tenant)
        answers = None if hello.max_answer_bytes is None else min(hello.max_answer_bytes, self.max_answer_bytes)
        conn.sessions[hello.cache_id] = _Session(hosted, claims, hello.identity, answers)
        return wire.encode_hello_ok(frame.request_id, cache_id=hello.cache_id, identity=hosted.spec,
                                    epoch=hosted.epoch, node_id=self.node_id, max_frame_bytes=self.max_frame_bytes,
                                    max_metadata_bytes=self.max_metadata_bytes, max_answer_bytes=answers)  # fmt: skip

    @staticmethod
    def _check_identity(hosted, identity) -> None:
        try:
            hosted.spec.check_matches(identity)
        except IdentityMismatch as exc:
            fields = {k: list(v) for k, v in exc.fields.items()}
            raise ProtocolError(ErrorCode.IDENTITY_MISMATCH, str(exc), details={"fields": fields}) from None

    # ---- sending ------------------------------------------------------------------------------------------------
    def _send_quietly(self, sock, buffers: list) -> None:
        try:
            sock.settimeout(1.0)
            send_buffers(sock, buffers)
        except (OSError, ssl.SSLError):
            pass


def _source_of(sock: socket.socket, addr) -> str:
    """Who a connection comes from, for the per-source limits: its address over TCP, its peer's uid over a Unix
    socket (SO_PEERCRED)."""
    if sock.family == socket.AF_UNIX:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return f"uds:{struct.unpack('3i', creds)[1]}"
        except OSError:
            return "uds"
    return str(addr[0]) if addr else "?"
