"""Request handling of the data-plane server: what a decoded frame asks of this node and what it is answered.

The connection side (gpu_node/dataplane/server.py: accept, TLS, deadlines, draining) reads frames and sends answers;
this side decides on each frame:

- before its payload arrives (`sink`): the request's metadata is validated, the connection must hold a session for
  the cache, the token must still be valid and unrevoked, `access == "readwrite"` for put/delete, the request's
  identity must equal the cache's, and the tenant's admission (and, for a put, the node's staging) must allow it.
  A refusal raises ProtocolError, so the decoder discards the payload: a refused put never allocates its KV;
- once the frame is whole (`handle`): HELLO opens a session (the token verified offline, then matched against a
  cache this node hosts at the token's epoch: every mismatch answers the same `not_found`), and data requests are
  dispatched to the cache's engine (gpu_node/dataplane/answers.py builds the PUT and GET answers);
- a failure becomes its answer (`error_answer`): MOVED for a cache that left, `not_found` for one purged meanwhile,
  the ProtocolError's own code, else `internal` (the exception text never leaves the node);
- once the answer is sent or lost (`answered`): the served KV is counted, the frame's admission, staging and held
  prefixes are given back and its buffers zeroed (Conn.frame_done), and its latency is observed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from gpu_node.agent.registry import CacheRegistry
from gpu_node.dataplane.admission import ConnectionGate, TenantAdmission
from gpu_node.dataplane.answers import answer_get, answer_put, count_served, release_prefixes
from gpu_node.dataplane.connection import Conn, Session
from gpu_node.dataplane.staging import StagingPool
from gpu_node.dataplane.tokens import TokenVerifier
from gpu_node.errors import NOT_FOUND_MESSAGE, NodeError, answer_error
from gpu_node.migration.fence import MovedError, fences_for
from kcaas import wire
from kcaas.spec import IdentityMismatch
from kcaas.wire import ErrorCode, Opcode, ProtocolError

log = logging.getLogger(__name__)

WRITE_OPS = frozenset({"put", "delete"})
AUTH_FAILURE_CODES = frozenset(
    {ErrorCode.UNAUTHENTICATED, ErrorCode.TOKEN_EXPIRED, ErrorCode.FORBIDDEN, ErrorCode.NOT_FOUND}
)


class RequestHandler:
    """Checks, dispatches and answers the requests of every connection of one DataPlaneServer (which owns the
    admission, the connection gate and the staging pool and shares them here). Stateless between frames: what a
    request holds lives on its Conn, keyed by id(frame meta)."""

    def __init__(
        self,
        registry: CacheRegistry,
        node_id: str,
        verifier: TokenVerifier,
        *,
        admission: TenantAdmission,
        gate: ConnectionGate,
        staging: StagingPool,
        metrics: Any,
        max_frame_bytes: int,
        max_metadata_bytes: int,
        max_answer_bytes: int,
    ):
        self.registry = registry
        self.node_id = node_id
        self.verifier = verifier
        self.admission = admission
        self.gate = gate
        self.staging = staging
        self.metrics = metrics
        self.max_frame_bytes = max_frame_bytes
        self.max_metadata_bytes = max_metadata_bytes
        self.max_answer_bytes = max_answer_bytes

    # ---- before the payload -------------------------------------------------------------------------------------
    def sink(self, conn: Conn, head: wire.FrameHead) -> Any:
        """Decide on a frame's payload from its metadata: refuse (ProtocolError -> discarded) or give buffers."""
        if head.opcode not in wire.DATA_OPS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{head.opcode.name} is not a request")
        request = self._checked_head(conn, head)
        conn.request_heads[id(head.meta)] = request  # handle() takes it: parsed once per frame
        kv_total = sum(request.kv_bytes) if request.carries_kv else 0
        tenant = self._tenant_of(conn, request)
        conn.holds[id(head.meta)] = self.admission.admit(tenant, kv_total)  # the tenant's budget, then the node's
        if not request.carries_kv:
            return None  # token ids only: small, the decoder buffers them
        return conn.put_buffers(id(head.meta), request.token_bytes, self.staging.lease(kv_total, tenant))

    def _checked_head(self, conn: Conn, head: wire.FrameHead) -> wire.RequestHead:
        """The request's metadata, validated and authorized; any other failure is `internal`, never its text."""
        try:
            request = self._request_head(conn, head)
            self._authorize(conn, request)
        except ProtocolError:
            raise
        except IdentityMismatch as exc:
            raise _identity_mismatch(exc) from None
        except Exception:
            log.exception("data-plane payload sink failed")
            raise ProtocolError(ErrorCode.INTERNAL, "internal error") from None
        return request

    def _request_head(self, conn: Conn, head: wire.FrameHead | wire.Frame) -> wire.RequestHead:
        """The request's metadata, validated; a request without identity takes its session's (checked at HELLO)."""
        session = conn.sessions.get(head.meta.get("cache_id", ""))  # "": no session has that id
        if session is None:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "send HELLO with a data token for this cache first")
        return wire.parse_request_head(head, session.identity)

    @staticmethod
    def _tenant_of(conn: Conn, request: wire.RequestHead) -> str:
        return str(conn.sessions[request.cache_id].claims["sub"])

    def _authorize(self, conn: Conn, request: wire.RequestHead) -> Session:
        session, hosted = self._session(conn, request.cache_id, request.op)
        if request.identity_sent:  # else the session's, checked against this cache at HELLO
            hosted.spec.check_matches(request.identity)
        return session

    def _session(self, conn: Conn, cache_id: str, op: str) -> tuple[Session, Any]:
        """The connection's session for a cache still hosted here in its epoch, its token still granting the
        request (not expired, not revoked, readwrite for a write): (session, the hosted cache). Raises ProtocolError
        otherwise."""
        write = op in WRITE_OPS
        session = conn.sessions.get(cache_id)
        if session is None:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "send HELLO with a data token for this cache first")
        fences_for(self.registry).check(cache_id, write=write)
        hosted = self.registry.get(cache_id)
        if hosted is None or hosted.epoch != session.hosted.epoch:
            conn.sessions.pop(cache_id, None)
            raise ProtocolError(ErrorCode.NOT_FOUND, NOT_FOUND_MESSAGE)
        claims = session.claims
        if time.time() >= float(claims["exp"]) + self.verifier.leeway:
            raise ProtocolError(ErrorCode.TOKEN_EXPIRED, "the data token has expired: send HELLO with a fresh one")
        if self.verifier.is_revoked(claims["jti"]):
            conn.sessions.pop(cache_id, None)
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "the data token has been revoked")
        if write and claims.get("access") != "readwrite":
            raise ProtocolError(ErrorCode.FORBIDDEN, f"a read-only token cannot {op}")
        return session, hosted

    # ---- a whole frame ------------------------------------------------------------------------------------------
    def handle(self, conn: Conn, frame: wire.Frame) -> list:
        """The answer's buffers for one decoded frame; raises what error_answer turns into the answer."""
        if frame.error is not None:
            raise frame.error
        if frame.opcode == Opcode.HELLO:
            return self._hello(conn, frame)
        if frame.opcode == Opcode.EVENTS:
            return self._events(conn, frame)
        if frame.opcode not in wire.DATA_OPS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{frame.opcode.name} is not a request")
        return self._data(conn, frame)

    def _data(self, conn: Conn, frame: wire.Frame) -> list:
        """LOOKUP/PUT/GET/DELETE (single or batch), authorized again: time passed since the sink, or it was
        skipped (no payload)."""
        request_head = conn.request_heads.pop(id(frame.meta), None) or self._request_head(conn, frame)
        session = self._authorize(conn, request_head)
        if id(frame.meta) not in conn.holds:  # no payload: admitted here, released by frame_done
            conn.holds[id(frame.meta)] = self.admission.admit(str(session.claims["sub"]))
        request = wire.parse_request(frame, request_head)
        tokens = [np.frombuffer(t, dtype=np.int32) for t in request.token_ids]
        engine, op, rid = session.hosted.engine, request_head.op, frame.request_id
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

    def _events(self, conn: Conn, frame: wire.Frame) -> list:
        """The cache's block events from `since`, for a session of that cache (its token: read access suffices);
        as many whole batches as fit in one frame (at least one: a batch is at most a few MiB)."""
        request = wire.parse_events_request(frame)
        _, hosted = self._session(conn, request.cache_id, "events")
        read = hosted.engine.read_events(request.since, request.max_batches)
        batches: list[tuple[int, bytes]] = []
        room = self.max_frame_bytes - self.max_metadata_bytes
        for seq, payload in read.batches:
            if batches and len(payload) > room:
                break
            batches.append((seq, payload))
            room -= len(payload)
        return wire.encode_events_ok(
            frame.request_id, first_seq=read.first_seq, next_seq=read.next_seq, batches=tuple(batches)
        )

    def _hello(self, conn: Conn, frame: wire.Frame) -> list:
        hello = wire.parse_hello(frame)  # through kcaas.wire: tests stand in an older node's parser there
        try:
            claims = self.verifier.verify(hello.token)
            hosted = self._hosted_for(hello, claims)
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
        conn.sessions[hello.cache_id] = Session(hosted, claims, hello.identity, answers)
        return wire.encode_hello_ok(
            frame.request_id,
            cache_id=hello.cache_id,
            identity=hosted.spec,
            epoch=hosted.epoch,
            node_id=self.node_id,
            max_frame_bytes=self.max_frame_bytes,
            max_metadata_bytes=self.max_metadata_bytes,
            max_answer_bytes=answers,
        )

    def _hosted_for(self, hello: wire.Hello, claims: dict):
        """The hosted cache a verified token opens, or MOVED (a token for a cache that left) or `not_found`."""
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
            try:
                hosted.spec.check_matches(hello.identity)
            except IdentityMismatch as exc:
                raise _identity_mismatch(exc) from None
        return hosted

    # ---- answers ------------------------------------------------------------------------------------------------
    def error_answer(self, frame: wire.Frame, exc: Exception) -> list:
        """The answer to a frame whose handling raised `exc`."""
        if isinstance(exc, MovedError):  # the cache is leaving or has left this node (gpu_node/migration/fence.py)
            return wire.encode_moved(frame.request_id, cache_id=exc.cache_id, endpoint=exc.endpoint, epoch=exc.epoch)
        if isinstance(exc, ProtocolError):
            if exc.code in AUTH_FAILURE_CODES and self.metrics is not None:
                self.metrics.auth_failures.labels(reason=exc.code).inc()
            return wire.encode_error_for(exc, frame.request_id)
        if isinstance(exc, NodeError) and exc.code != ErrorCode.INTERNAL:  # e.g. CachePurged: not_found, never zeros
            return wire.encode_error_for(answer_error(exc), frame.request_id)
        log.error("data-plane request failed", exc_info=exc)
        return wire.encode_error(frame.request_id, ErrorCode.INTERNAL, "internal error")

    def answered(self, conn: Conn, frame: wire.Frame, started: float, *, sent: bool) -> None:
        """The frame's answer went out whole (`sent`) or could not: count the KV it served, give back what it held,
        and observe its latency since `started` (time.perf_counter)."""
        try:
            if sent:
                count_served(conn)  # before frame_done, which forgets what the answer served
        finally:
            self.frame_done(conn, frame)
        if sent and self.metrics is not None:
            op = wire.OP_NAMES.get(Opcode(frame.opcode & ~wire.BATCH_BIT))
            if op is not None:
                self.metrics.request_seconds.labels(op=op).observe(time.perf_counter() - started)

    def release(self, conn: Conn) -> set[str]:
        """The connection is closing: give back the admissions it holds (its frames' and its tenants' connections)
        and the prefixes it holds. Returns the tenants it served (their idle staging is then zeroed)."""
        for hold in conn.holds.values():
            hold.release()
        conn.holds.clear()
        release_prefixes(conn)
        for tenant in conn.tenants:
            self.admission.disconnect(tenant)
        tenants, conn.tenants = set(conn.tenants), set()
        return tenants

    @staticmethod
    def frame_done(conn: Conn, frame: wire.Frame) -> None:
        """The frame is answered: give back its admission and, if it was the one using it, the put staging; zero
        the buffers its request and answer went through (Conn.frame_done)."""
        hold = conn.holds.pop(id(frame.meta), None)
        if hold is not None:
            hold.release()
        conn.request_heads.pop(id(frame.meta), None)
        release_prefixes(conn)
        conn.served = None
        conn.frame_done(id(frame.meta), frame.payload)


def _identity_mismatch(exc: IdentityMismatch) -> ProtocolError:
    fields = {k: list(v) for k, v in exc.fields.items()}
    return ProtocolError(ErrorCode.IDENTITY_MISMATCH, str(exc), details={"fields": fields})
