"""The SDK's data-plane client: lookup/put/get/delete of one cache's KV on its node, over TLS 1.3 or a Unix socket.

    tokens = kcaas.TokenSource(client, cache.id)
    dp = DataPlaneClient(cache.endpoint, tokens, cache.id, spec)      # or uds_path="/run/kcaas/node.sock"
    n = dp.lookup(token_ids)
    dp.put(token_ids, kv)          # kv: torch tensor [num_layers, 2, n, num_kv_heads, head_dim] in spec.kv_dtype
    n, kv = dp.get(token_ids)      # the longest cached prefix and its KV
    dp.delete(token_ids)

One connection per client, opened lazily and reused; one request at a time (a lock serializes threads: give each
engine thread its own client for concurrency). The client sends HELLO first and checks its engine's identity against
the cache's locally, so a mismatched layout fails before any KV crosses the wire. Requests larger than the node's
`max_frame_bytes` are split (`kv_start`) and long GETs are continued until the whole cached prefix has arrived.

Retries: every operation is idempotent (a repeated put deduplicates), so on a refused token (expired, revoked, not
valid for this placement) the client refreshes it once through its TokenSource (invalidate() + get()) and retries,
on a broken connection (or a node that is shutting down) it reconnects once and retries, and on `overloaded` (a
per-tenant limit on the node) it waits the node's `retry_after_ms`, doubling with jitter up to 1 s, at most
`max_overloaded_retries` times, then raises. On MOVED (the cache migrated) it refreshes its token and, once the
token is for the announced epoch, reconnects to the announced endpoint and retries (`_follow_move`).

torch is imported lazily, inside the methods that take or return tensors: `import kcaas.dataplane` stays light.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import ssl
import threading
import time
from typing import Any

from kcaas import wire
from kcaas.errors import KcaasError
from kcaas.spec import KVCacheSpec
from kcaas.wire import ErrorCode, Opcode, ProtocolError

CLIENT_NAME = "kcaas-py-dataplane/0.1"
REFRESH_CODES = frozenset({ErrorCode.TOKEN_EXPIRED, ErrorCode.UNAUTHENTICATED, ErrorCode.NOT_FOUND})
_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


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


class DataPlaneClient:
    def __init__(
        self,
        endpoint: str | None = None,
        token: Any = None,
        cache_id: str = "",
        identity: KVCacheSpec | None = None,
        *,
        uds_path: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 60.0,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        max_overloaded_retries: int = 8,
    ):
        if (endpoint is None) == (uds_path is None):
            raise ValueError("give exactly one of endpoint ('host:port') and uds_path")
        if token is None or not cache_id or identity is None:
            raise ValueError("token (a TokenSource, DataToken or string), cache_id and identity are required")
        self.endpoint, self.uds_path = endpoint, uds_path
        self.cache_id = str(cache_id)
        self.identity = identity
        self._token_source = token
        self.timeout = timeout
        self.max_overloaded_retries = max_overloaded_retries
        self.max_move_waits = 100  # MOVED while the cutover is in progress: at most ~1 minute of waiting
        self._max_frame_bytes = max_frame_bytes  # the node's limit replaces it after HELLO
        self.server_hostname = server_hostname
        if endpoint is not None and ssl_context is None:
            ssl_context = ssl.create_default_context()
        if ssl_context is not None:
            ssl_context.minimum_version = max(ssl_context.minimum_version, ssl.TLSVersion.TLSv1_3)
        self.ssl_context = ssl_context
        self._lock = threading.RLock()
        self._receive_into: memoryview | None = None  # get(out=)'s staging bytes while its request is in flight
        self._sock: socket.socket | None = None
        self._decoder: wire.FrameDecoder | None = None
        self._next_id = 1
        self.hello: wire.HelloOk | None = None

    def __repr__(self) -> str:
        where = self.endpoint or self.uds_path
        return f"DataPlaneClient({where!r}, cache_id={self.cache_id!r})"

    @property
    def read_only(self) -> bool:
        """True when this client's data token grants reads only (the node refuses its puts and deletes): what a
        connector checks to run decode-only. From the TokenSource's or DataToken's access, or a raw token's claim."""
        source = self._token_source
        access = getattr(source, "access", None)
        if access is None and isinstance(source, str):
            access = _unverified_claims(source).get("access")
        return access is not None and access != "readwrite"

    # ---- public operations ------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Open the connection and send HELLO now (otherwise the first request does): a caller with a tight
        per-request timeout pays the handshake ahead of time."""
        self._connect()

    def settimeout(self, seconds: float) -> None:
        """The per-operation timeout from now on, the open connection's included."""
        with self._lock:
            self.timeout = seconds
            if self._sock is not None:
                self._sock.settimeout(seconds)

    def lookup(self, tokens) -> int:
        """How many leading tokens of `tokens` the cache holds."""
        reply = self._call(Opcode.LOOKUP, tokens)
        return reply.num_cached[0]

    def delete(self, tokens) -> int:
        """Forget the cached prefix of `tokens` and everything stored under it; returns the blocks removed."""
        reply = self._call(Opcode.DELETE, tokens)
        return reply.num_removed_blocks[0]

    def put(self, tokens, kv, *, start: int = 0) -> dict:
        """Store the KV of every token of `tokens` (kv: [num_layers, 2, n, num_kv_heads, head_dim], spec.kv_dtype).

        `start`: kv holds tokens[start:] only (n - start tokens), the cache already holding tokens[:start] (a node
        that no longer does refuses with `prefix_not_cached`). Returns {"num_cached", "num_written",
        "out_of_space"}; a sequence larger than a frame goes in several frames.
        """
        import torch

        spec = self.identity
        ids = _as_int32(tokens)
        n = len(ids)
        if not 0 <= start <= n:
            raise ValueError(f"start must be within 0..{n}")
        expected = (spec.num_layers, 2, n - start, spec.num_kv_heads, spec.head_dim)
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expected:
            raise ValueError(f"kv must be a tensor of shape {expected}")
        if kv.dtype != getattr(torch, _TORCH_DTYPES[spec.kv_dtype]):
            raise ValueError(f"kv must be {spec.kv_dtype}")
        kv = kv.detach()
        if kv.device.type != "cpu":
            kv = kv.cpu()
        self._connect()  # the node's frame limit is known after HELLO
        per_frame = max(1, (self._max_frame_bytes - wire.HEADER_SIZE - 8192 - 4 * n) // spec.kv_bytes_per_token)
        written, first, reply = 0, start, None
        if start == n:
            return {"num_cached": n, "num_written": 0, "out_of_space": False}
        while start < n:
            end = min(n, start + per_frame)
            part = kv[:, :, start - first : end - first].contiguous()
            kv_bytes = memoryview(part.view(torch.uint8).reshape(-1).numpy())
            reply = self._call(Opcode.PUT, ids[:end], kv=kv_bytes, kv_start=start)
            written += reply.num_written[0]
            if reply.out_of_space[0] or reply.num_cached[0] < end:
                break
            start = end
        return {"num_cached": reply.num_cached[0], "num_written": written, "out_of_space": reply.out_of_space[0]}

    def get(self, tokens, *, out=None, start: int = 0):
        """(n, kv): the longest cached prefix of `tokens` and its KV [num_layers, 2, n, num_kv_heads, head_dim].

        `start`: only the KV of tokens[start:n] is sent (a caller that holds the first `start` tokens' KV itself);
        kv then has n - start tokens, and n < start when not even tokens[:start] are cached (kv is empty).
        `out`: an optional reusable staging tensor (contiguous, CPU, the kv dtype, room for len(tokens) - start
        tokens): the answer is received straight into it and kv is a view of it — no fresh buffer per get (its page
        faults cost more than the transfer). Without it, each get allocates its result.
        """
        import torch

        spec = self.identity
        ids = _as_int32(tokens)
        if not 0 <= start <= len(ids):
            raise ValueError(f"start must be within 0..{len(ids)}")
        dtype = getattr(torch, _TORCH_DTYPES[spec.kv_dtype])
        staging = self._staging_view(out, dtype, len(ids) - start)
        parts, first, cached = [], start, 0
        while True:
            self._receive_into = staging if start == first else None  # a continuation part is cat-ed below
            try:
                reply = self._call(Opcode.GET, ids, kv_start=start)
            finally:
                self._receive_into = None
            end, cached = reply.kv_end[0], reply.num_cached[0]
            if end > start:
                shape = (spec.num_layers, 2, end - start, spec.num_kv_heads, spec.head_dim)
                parts.append(torch.frombuffer(reply.kv[0], dtype=dtype).view(shape))
            if end >= cached or end <= start:
                break  # all of the cached prefix arrived (or it shrank under us: return what arrived)
            start = end  # the node's frame limit cut the answer short: continue from there
        if not parts:
            empty = torch.empty((spec.num_layers, 2, 0, spec.num_kv_heads, spec.head_dim), dtype=dtype)
            return min(cached, first), empty
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return first + kv.shape[2], kv

    def _staging_view(self, out, dtype, num_tokens: int):
        if out is None:
            return None
        if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU tensor of {dtype}")
        if out.numel() < num_tokens * self.identity.elements_per_token:
            raise ValueError(f"out must have room for {num_tokens} tokens of KV")
        import torch

        return memoryview(out.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes, writable

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plumbing ---------------------------------------------------------------------------------------------------
    def _token(self) -> str:
        src = self._token_source
        if isinstance(src, str):
            return src
        if hasattr(src, "get"):
            src = src.get()
        return src.token

    def _refresh_token(self) -> bool:
        src = self._token_source
        if hasattr(src, "invalidate") and hasattr(src, "get"):
            src.invalidate()
            return True
        return False

    def _follow_move(self, details: dict, attempt: int) -> bool:
        """MOVED: get a token for the new placement; once the control plane issues one at the announced epoch (or
        later), reconnect to the new endpoint; until then wait (the cache is fenced for the cutover) and retry."""
        if not self._refresh_token():
            return False
        epoch = getattr(self._token_source.get(), "epoch", None)
        if epoch is not None and int(epoch) < int(details.get("epoch", 0)):
            time.sleep(_backoff(50, min(attempt, 4)))  # the placement has not flipped yet: ask again shortly
            return True
        self.endpoint, self.uds_path = str(details["endpoint"]), None
        if self.ssl_context is None:
            self.ssl_context = ssl.create_default_context()
        self._drop()
        return True

    def _call(self, opcode: Opcode, tokens, *, kv=None, kv_start: int = 0):
        """One request with the retry policy (the module's docstring)."""
        return self._with_retries(lambda: self._request(opcode, tokens, kv=kv, kv_start=kv_start))

    def _connect(self) -> None:
        """Connected and HELLO answered, under the same retry policy as a request."""
        self._with_retries(lambda: None)

    def _with_retries(self, attempt):
        with self._lock:
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
                        raise DataPlaneError(f"data-plane connection lost: {exc}", code="connection_error") from None
                    reconnected = True

    def _ensure_connected(self) -> None:
        if self._sock is not None:
            return
        try:
            if self.uds_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(self.uds_path)
            else:
                host, _, port = self.endpoint.rpartition(":")
                host = host.strip("[]")
                raw = socket.create_connection((host, int(port)), timeout=self.timeout)
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    sock = self.ssl_context.wrap_socket(raw, server_hostname=self.server_hostname or host)
                except BaseException:
                    raw.close()
                    raise
        except (OSError, ssl.SSLError) as exc:
            raise DataPlaneError(f"cannot connect to the data plane: {exc}", code="connection_error") from None
        self._sock = sock
        self._decoder = wire.FrameDecoder(max_frame_bytes=max(self._max_frame_bytes, wire.DEFAULT_MAX_FRAME_BYTES),
                                          payload_sink=self._sink)  # fmt: skip
        try:
            rid = self._new_id()
            self._send(wire.encode_hello(rid, cache_id=self.cache_id, token=self._token(), client=CLIENT_NAME))
            reply = self._response(rid, Opcode.HELLO)
            reply.identity.check_matches(self.identity)  # a mismatched layout fails before any KV is sent
        except BaseException:
            self._drop()
            raise
        self.hello = reply
        self._max_frame_bytes = reply.max_frame_bytes

    def _sink(self, head: wire.FrameHead) -> Any:
        # a GET answer's KV goes straight into one fresh buffer (torch.frombuffer views it later): no copy
        if head.opcode == Opcode.OK and head.meta.get("op") == "get":
            sizes = wire.get_response_sizes(head.meta, self.identity)
            if sizes is not None and sum(sizes) == head.payload_len:
                staging = self._receive_into
                fits = staging is not None and len(sizes) == 1 and staging.nbytes >= head.payload_len
                buf = staging[: head.payload_len] if fits else bytearray(head.payload_len)
                views, pos = [], 0
                for size in sizes:
                    views.append(memoryview(buf)[pos : pos + size])
                    pos += size
                return views
        return None

    def _request(self, opcode: Opcode, tokens, *, kv=None, kv_start: int = 0):
        rid = self._new_id()
        kwargs: dict[str, Any] = {}
        if opcode in (Opcode.PUT, Opcode.GET):
            kwargs["kv_start"] = [kv_start]
        if opcode == Opcode.PUT:
            kwargs["kv"] = [kv]
        frame = wire.encode_request(opcode, rid, cache_id=self.cache_id, identity=self.identity, token_ids=[tokens],
                                    max_frame_bytes=self._max_frame_bytes, **kwargs)  # fmt: skip
        self._send(frame)
        return self._response(rid, opcode)

    def _response(self, rid: int, opcode: Opcode):
        frame = self._read_frame()
        if frame.request_id != rid:
            self._drop()
            raise DataPlaneError("the node answered another request", code="bad_response")
        try:
            reply = wire.parse_response(frame, request_opcode=opcode, num_sequences=1, spec=self.identity)
        except ProtocolError as exc:
            self._drop()
            raise DataPlaneError(f"malformed answer from the node: {exc.message}", code=exc.code) from None
        if isinstance(reply, wire.ErrorReply):
            raise DataPlaneError(reply.message, code=reply.code, details=reply.details)
        if isinstance(reply, wire.Moved):
            self._drop()
            raise DataPlaneError(f"the cache moved to {reply.endpoint} (epoch {reply.epoch})", code="moved",
                                 details={"endpoint": reply.endpoint, "epoch": reply.epoch})  # fmt: skip
        return reply

    def _read_frame(self) -> wire.Frame:
        decoder, sock = self._decoder, self._sock
        while True:
            frame = decoder.next_frame()
            if frame is not None:
                return frame
            try:
                buf = decoder.get_buffer()
                n = sock.recv_into(buf)
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
            small = sum(memoryview(b).nbytes for b in buffers)
            if small <= 64 * 1024:
                self._sock.sendall(b"".join(bytes(b) if not isinstance(b, bytes) else b for b in buffers))
                return
            for b in buffers:
                view = memoryview(b)
                if view.nbytes:
                    self._sock.sendall(view if view.format == "B" else view.cast("B"))
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


def _as_int32(tokens):
    """Token ids as an int32 memoryview (zero copy for int32 numpy arrays / array('i'); tensors via numpy)."""
    from array import array

    if hasattr(tokens, "detach") and hasattr(tokens, "numpy"):  # a torch tensor
        import torch

        tokens = tokens.detach().to("cpu", torch.int32).contiguous().numpy()
    try:
        view = memoryview(tokens)
        if view.ndim == 1 and view.itemsize == 4 and view.format.lstrip("<=@") in ("i", "l"):
            return view if view.c_contiguous else memoryview(array("i", view.tolist()))
        tokens = view.tolist()
    except TypeError:
        pass
    try:
        return memoryview(array("i", list(tokens)))
    except (OverflowError, TypeError, ValueError):
        raise ValueError("token ids must be int32 integers") from None


def _unverified_claims(token: str) -> dict:
    """The claims of a JWT read without verifying it (the node verifies; this only tells the client what it holds)."""
    try:
        body = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (IndexError, ValueError):
        return {}
