"""The SDK data-plane client's connection: one socket to one node (TLS 1.3 or a Unix socket), HELLO, framing and the
retry policy. `kcaas.dataplane.DataPlaneClient` builds the requests on top of it; nothing else uses it.

HELLO carries the engine's identity, which the node checks once for the session (and the client checks the cache's
identity it answers with); requests then leave the identity out. A node that predates this refuses an identity in
HELLO: the transport then says HELLO without it and sends the identity with every request, as before.

A GET answer's KV is received straight into memory the caller chose: each sequence's receiver (DataPlaneClient's)
says where, once the answer's metadata has arrived, so the parts of a long GET land at their offsets of one buffer
and are never joined.

Retries: every operation is idempotent (a repeated put deduplicates), so on a refused token (expired, revoked, not
valid for this placement) the client refreshes it once through its TokenSource (invalidate() + get()) and retries,
on a broken connection (or a node that is shutting down) it reconnects once and retries, and on `overloaded` (a
per-tenant limit on the node) it waits the node's `retry_after_ms`, doubling with jitter up to 1 s, at most
`max_overloaded_retries` times, then raises. On MOVED (the cache migrated) it refreshes its token and, once the
token is for the announced epoch, reconnects to the announced endpoint and retries (`_follow_move`).
"""

from __future__ import annotations

import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from kcaas import wire
from kcaas.errors import KcaasError
from kcaas.spec import KVCacheSpec
from kcaas.wire import ErrorCode, Opcode, ProtocolError
from kcaas.wire.sendbuffers import send_buffers

CLIENT_NAME = "kcaas-py-dataplane/0.2"
REFRESH_CODES = frozenset({ErrorCode.TOKEN_EXPIRED, ErrorCode.UNAUTHENTICATED, ErrorCode.NOT_FOUND})
# The largest GET answer this client takes in one frame: it lands in the caller's out (or one buffer sized from the
# answer and bounded by the tokens asked), so the bound is the node's to choose.
MAX_ANSWER_BYTES = 1 << 40
_FILL_BYTES = 4 << 20  # a read into a payload's own memory goes on for up to this much before the decoder is told


class DataPlaneError(KcaasError):
    """The node refused a request (`code` is a wire.ErrorCode) or the stream broke (`connection_error`)."""

    default_code = "dataplane_error"


class _ConnectionLost(Exception):
    pass


def _backoff(retry_after_ms: Any, attempt: int) -> float:
    """The node's hint (default 50 ms), doubled per attempt, capped at 1 s, with up to 50% jitter."""
    try:
        base = max(float(retry_after_ms) / 1000.0, 0.001)
    except (TypeError, ValueError):
        base = 0.05
    return min(base * 2**attempt, 1.0) * (1.0 + 0.5 * random.random())


def _recv(sock, view: memoryview, limit: int) -> int:
    """One read into `view`; with a `limit`, reads until that many bytes are in (or the stream ends: the next read
    says so). A failed read raises, whatever arrived before it: the connection is dropped and the request retried."""
    if not limit:
        return sock.recv_into(view)
    n = sock.recv_into(view, limit)
    while 0 < n < limit:
        got = sock.recv_into(view[n:], limit - n)
        if not got:
            break
        n += got
    return n


class Transport:
    """One connection with its retry policy. Not thread safe on its own: DataPlaneClient holds `lock` around each
    operation (an operation may be several requests: the frames of a long put or get)."""

    def __init__(
        self,
        endpoint: str | None,
        uds_path: str | None,
        token_source: Any,
        cache_id: str,
        identity: KVCacheSpec,
        *,
        ssl_context: ssl.SSLContext | None,
        server_hostname: str | None,
        timeout: float,
        max_frame_bytes: int,
        max_overloaded_retries: int,
    ):
        self.endpoint, self.uds_path = endpoint, uds_path
        self.token_source = token_source
        self.cache_id = cache_id
        self.identity = identity
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes  # the node's limit replaces it after HELLO
        self.max_metadata_bytes = wire.DEFAULT_MAX_METADATA_BYTES
        self.max_overloaded_retries = max_overloaded_retries
        self.max_move_waits = 100  # MOVED while the cutover is in progress: at most ~1 minute of waiting
        self.lock = threading.RLock()
        self.hello: wire.HelloOk | None = None
        self.identity_in_hello = True  # False once a node refused it there: every request carries it then
        self._sock: socket.socket | None = None
        self._decoder: wire.FrameDecoder | None = None
        self._next_id = 1
        self._receive_into: list | None = None  # the GET in flight: one receiver per sequence
        # a streaming GET's receiver: told the answer's payload bytes received so far before each read into the
        # payload (and once the frame is whole), it reports the layers complete and answers how many more bytes
        # may be read before it is told again
        self.on_payload: Callable[[int], int] | None = None

    # ---- operations ---------------------------------------------------------------------------------------------
    def call(
        self,
        opcode: Opcode,
        token_ids: list,
        *,
        kv: list | None = None,
        kv_start: list | None = None,
        receive_into: list | None = None,
    ):
        """One request (any data opcode, single or batch) under the retry policy; returns its typed reply.

        GET: `receive_into[i].views_for(num_cached, kv_start, kv_end)` says where sequence i's KV goes, once the
        answer's metadata has arrived (writable views whose sizes add up to that KV)."""

        def attempt():
            self._receive_into = receive_into
            try:
                return self._request(opcode, token_ids, kv=kv, kv_start=kv_start)
            finally:
                self._receive_into = None

        return self._with_retries(attempt)

    def call_events(self, since: int, max_batches: int):
        """One EVENTS request under the retry policy; returns its wire.EventsOk."""

        def attempt():
            rid = self._new_id()
            self._send(wire.encode_events_request(rid, cache_id=self.cache_id, since=since, max_batches=max_batches))
            return self._response(rid, Opcode.EVENTS, 1)

        return self._with_retries(attempt)

    def connect(self) -> None:
        """Connected and HELLO answered, under the same retry policy as a request."""
        self._with_retries(lambda: None)

    def settimeout(self, seconds: float) -> None:
        self.timeout = seconds
        if self._sock is not None:
            self._sock.settimeout(seconds)

    def close(self) -> None:
        self._drop()

    # ---- the retry policy -----------------------------------------------------------------------------------------
    def _with_retries(self, attempt):
        with self.lock:
            refreshed = reconnected = False
            waits = moves = 0
            while True:
                try:
                    self._ensure_connected()
                    return attempt()
                except DataPlaneError as exc:
                    if exc.code in REFRESH_CODES and not refreshed and self._refresh_token():
                        refreshed = True
                        self._drop()  # the next attempt sends HELLO with the fresh token
                        continue
                    if exc.code == "moved" and moves < self.max_move_waits and self._follow_move(exc.details, moves):
                        moves += 1
                        continue
                    if exc.code == ErrorCode.OVERLOADED and waits < self.max_overloaded_retries:
                        time.sleep(_backoff(exc.details.get("retry_after_ms"), waits))
                        waits += 1
                        continue
                    if exc.code == ErrorCode.SHUTTING_DOWN and not reconnected:
                        reconnected = True
                        self._drop()
                        continue
                    raise
                except _ConnectionLost as exc:
                    self._drop()
                    if reconnected:
                        raise DataPlaneError(
                            f"data-plane connection lost: {exc}", code="connection_error", details=self._where()
                        ) from None
                    reconnected = True

    def _token(self) -> str:
        src = self.token_source
        if isinstance(src, str):
            return src
        if hasattr(src, "get"):
            src = src.get()
        return src.token

    def _refresh_token(self) -> bool:
        src = self.token_source
        if hasattr(src, "invalidate") and hasattr(src, "get"):
            src.invalidate()
            return True
        return False

    def _follow_move(self, details: dict, attempt: int) -> bool:
        """MOVED: get a token for the new placement; once the control plane issues one at the announced epoch (or
        later), reconnect to the new endpoint; until then wait (the cache is fenced for the cutover) and retry."""
        if not self._refresh_token():
            return False
        epoch = getattr(self.token_source.get(), "epoch", None)
        if epoch is not None and int(epoch) < int(details.get("epoch", 0)):
            time.sleep(_backoff(50, min(attempt, 4)))  # the placement has not flipped yet: ask again shortly
            return True
        self.endpoint, self.uds_path = str(details["endpoint"]), None
        if self.ssl_context is None:
            self.ssl_context = ssl.create_default_context()
        self._drop()
        return True

    # ---- connection ---------------------------------------------------------------------------------------------
    def _ensure_connected(self) -> None:
        if self._sock is not None:
            return
        self._sock = self._open_socket()
        self._decoder = wire.FrameDecoder(
            max_frame_bytes=max(self.max_frame_bytes, wire.DEFAULT_MAX_FRAME_BYTES), payload_sink=self._sink
        )
        try:
            try:
                reply = self._hello()
            except DataPlaneError as exc:  # a node that predates identity in HELLO: say it with every request
                if not (self.identity_in_hello and exc.code == ErrorCode.BAD_REQUEST and "unknown" in exc.message):
                    raise
                self.identity_in_hello = False
                reply = self._hello()
            reply.identity.check_matches(self.identity)  # a mismatched layout fails before any KV is sent
        except BaseException:
            self._drop()
            raise
        self.hello = reply
        self.max_frame_bytes = reply.max_frame_bytes
        self.max_metadata_bytes = reply.max_metadata_bytes
        if reply.max_answer_bytes is not None:  # GET answers may be larger than request frames
            self._decoder.max_frame_bytes = max(self._decoder.max_frame_bytes, reply.max_answer_bytes)

    def _hello(self) -> wire.HelloOk:
        rid = self._new_id()
        modern = self.identity_in_hello  # an older node refuses both fields
        self._send(
            wire.encode_hello(
                rid,
                cache_id=self.cache_id,
                token=self._token(),
                client=CLIENT_NAME,
                identity=self.identity if modern else None,
                max_answer_bytes=MAX_ANSWER_BYTES if modern else None,
            )
        )
        return self._response(rid, Opcode.HELLO, 1)

    def _open_socket(self) -> socket.socket:
        try:
            if self.uds_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(self.uds_path)
                return sock
            # DataPlaneClient gives an endpoint a TLS context (its own default when the caller gave none).
            assert self.endpoint is not None and self.ssl_context is not None, "an endpoint or a socket path"
            host, _, port = self.endpoint.rpartition(":")
            host = host.strip("[]")
            raw = socket.create_connection((host, int(port)), timeout=self.timeout)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                return self.ssl_context.wrap_socket(raw, server_hostname=self.server_hostname or host)
            except BaseException:
                raw.close()
                raise
        except (OSError, ssl.SSLError) as exc:
            raise DataPlaneError(
                f"cannot connect to the data plane: {exc}", code="connection_error", details=self._where()
            ) from None

    def _where(self) -> dict[str, str]:
        """The node address this connection dials, for a connection error's hint (kcaas.errors.hint_for)."""
        return {"endpoint": self.endpoint} if self.endpoint else {"uds_path": str(self.uds_path)}

    def _sink(self, head: wire.FrameHead) -> Any:
        """A GET answer's KV straight into where each sequence's receiver puts it (`receive_into[i].views_for`):
        no copy, nothing joined."""
        if head.opcode != Opcode.OK or head.meta.get("op") != "get" or self._receive_into is None:
            return None
        sizes = wire.get_response_sizes(head.meta, self.identity)
        if sizes is None or sum(sizes) != head.payload_len or len(sizes) != len(self._receive_into):
            return None  # malformed: let the decoder buffer it and parse_response say what is wrong
        meta, views = head.meta, []
        for index, receiver in enumerate(self._receive_into):
            if sizes[index]:
                views += receiver.views_for(
                    int(meta["num_cached"][index]), int(meta["kv_start"][index]), int(meta["kv_end"][index])
                )
        return views

    def _request(self, opcode: Opcode, token_ids: list, *, kv=None, kv_start=None):
        rid = self._new_id()
        identity = None if self.identity_in_hello else self.identity
        frame = wire.encode_request(
            opcode,
            rid,
            cache_id=self.cache_id,
            identity=identity,
            token_ids=token_ids,
            kv=kv,
            kv_start=kv_start,
            max_frame_bytes=self.max_frame_bytes,
            session_identity=self.identity,
        )
        self._send(frame)
        return self._response(rid, opcode, len(token_ids))

    def _response(self, rid: int, opcode: Opcode, num_sequences: int):
        frame = self._read_frame()
        if frame.request_id != rid:
            self._drop()
            raise DataPlaneError("the node answered another request", code="bad_response")
        try:
            reply = wire.parse_response(frame, request_opcode=opcode, num_sequences=num_sequences, spec=self.identity)
        except ProtocolError as exc:
            self._drop()
            raise DataPlaneError(f"malformed answer from the node: {exc.message}", code=exc.code) from None
        if isinstance(reply, wire.ErrorReply):
            raise DataPlaneError(reply.message, code=reply.code, details=reply.details)
        if isinstance(reply, wire.Moved):
            self._drop()
            raise DataPlaneError(
                f"the cache moved to {reply.endpoint} (epoch {reply.epoch})",
                code="moved",
                details={"endpoint": reply.endpoint, "epoch": reply.epoch},
            )
        return reply

    def _read_frame(self) -> wire.Frame:
        """The next frame. Into a payload's own memory (a GET's `out`), reads go on back to back up to
        _FILL_BYTES (or to the next layer a streaming GET reports) before the decoder is told: a TLS read returns
        one 16 KiB record, and the decoder's bookkeeping and a report per record are CPU the client does not
        spend now (bench.hit_cost: `recv_decrypt_cpu`)."""
        decoder, sock = self._decoder, self._sock
        assert decoder is not None and sock is not None, "a frame is read on an open connection"
        while True:
            frame = decoder.next_frame()
            if frame is not None:
                if self.on_payload is not None and frame.payload:
                    self.on_payload(frame.payload_len)  # the last layers, in with the frame's last bytes
                return frame
            view = decoder.get_buffer()
            limit = 0  # 0: one read of what comes (the decoder's scratch buffer)
            if decoder.buffer_is_payload:
                limit = min(view.nbytes, _FILL_BYTES)
                if self.on_payload is not None:
                    limit = min(limit, self.on_payload(decoder.payload_received))
            try:
                n = _recv(sock, view, limit)
            except (OSError, ssl.SSLError) as exc:
                raise _ConnectionLost(str(exc) or type(exc).__name__) from None
            if n == 0:
                raise _ConnectionLost("the node closed the connection")
            try:
                decoder.buffer_updated(n)
            except ProtocolError as exc:
                self._drop()
                raise DataPlaneError(f"malformed stream from the node: {exc.message}", code=exc.code) from None

    def _send(self, buffers: list) -> None:
        try:
            send_buffers(self._sock, buffers)  # header, ids and KV in one sendmsg on a Unix socket
        except (OSError, ssl.SSLError) as exc:
            raise _ConnectionLost(str(exc) or type(exc).__name__) from None

    def _new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._decoder = None
        self.hello = None
