"""The SDK's data-plane client: lookup/put/get/delete of one cache's KV on its node, over TLS 1.3 or a Unix socket.

    tokens = kcaas.TokenSource(client, cache.id, access="readwrite")   # "read" (the default): lookup and get only
    dp = DataPlaneClient(cache.endpoint, tokens, cache.id, spec)      # or uds_path="/run/kcaas/node.sock"
    n = dp.lookup(token_ids)
    dp.put(token_ids, kv)          # kv: torch tensor [num_layers, 2, n, num_kv_heads, head_dim] in spec.kv_dtype
    n, kv = dp.get(token_ids)      # the longest cached prefix and its KV
    dp.delete(token_ids)
    dp.lookup_batch([a, b, c])     # the batch forms: many sequences, one round trip (split only by frame limits)
    dp.get_batch([a, b], outs=[staging_a, staging_b]);  dp.put_batch([(a, kv_a), (b, kv_b)])

One connection per client, opened lazily and reused; one request at a time (a lock serializes threads: give each
engine thread its own client for concurrency). The client sends its engine's identity with HELLO, where the node
checks it once, and checks the cache's identity locally, so a mismatched layout fails before any KV crosses the wire.
A sequence larger than the node's `max_frame_bytes` goes in several frames: each put frame carries only its own
tokens' KV (`kv_start`) and is appended after what the node holds; each part of a long GET lands at its offset of the
caller's `out` (or of one buffer sized for the whole answer): nothing is read back, joined or copied. The connection,
HELLO and the retry policy are kcaas/dataplane_transport.py.

torch is imported lazily, inside the methods that take or return tensors: `import kcaas.dataplane` stays light.
"""

from __future__ import annotations

import base64
import json
import ssl
from dataclasses import dataclass
from typing import Any

from kcaas import wire
from kcaas.dataplane_receive import Received, Recent, streaming
from kcaas.dataplane_transport import DataPlaneError, Transport
from kcaas.spec import KVCacheSpec
from kcaas.wire import BATCH_BIT, ErrorCode, Opcode

__all__ = ["DataPlaneClient", "DataPlaneError"]

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
_FRAME_SLACK = 8192  # header and metadata room left in a frame the client fills with KV
_MAX_PREFIX_RETRIES = 3  # a long put whose prefix the node evicted between frames resumes from what it holds


@dataclass(frozen=True)
class CacheEvents:
    """DataPlaneClient.events' answer (docs/routing.md, "Events out")."""

    first_seq: int  # the oldest batch the node still keeps
    next_seq: int  # read on from here
    batches: tuple  # ((seq, kcaas.kv_events.EventBatch), ...), seq ascending
    missed: bool  # batches asked for are gone (older than first_seq)


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
        if endpoint is not None and ssl_context is None:
            ssl_context = ssl.create_default_context()
        if ssl_context is not None:
            ssl_context.minimum_version = max(ssl_context.minimum_version, ssl.TLSVersion.TLSv1_3)
        self.identity = identity
        self.cache_id = str(cache_id)
        self._views = Recent()  # the bytes of recent `out` tensors, and the result views made of them
        self._t = Transport(
            endpoint,
            uds_path,
            token,
            self.cache_id,
            identity,
            ssl_context=ssl_context,
            server_hostname=server_hostname,
            timeout=timeout,
            max_frame_bytes=max_frame_bytes,
            max_overloaded_retries=max_overloaded_retries,
        )

    def __repr__(self) -> str:
        where = self._t.endpoint or self._t.uds_path
        return f"DataPlaneClient({where!r}, cache_id={self.cache_id!r})"

    @property
    def endpoint(self) -> str | None:
        return self._t.endpoint

    @property
    def hello(self) -> wire.HelloOk | None:
        """The node's answer to this connection's HELLO (None while not connected)."""
        return self._t.hello

    @property
    def timeout(self) -> float:
        return self._t.timeout

    @property
    def read_only(self) -> bool:
        """True when this client's data token grants reads only (the node refuses its puts and deletes): what a
        connector checks to run decode-only. From the TokenSource's or DataToken's access, or a raw token's claim."""
        source = self._t.token_source
        access = getattr(source, "access", None)
        if access is None and isinstance(source, str):
            access = _unverified_claims(source).get("access")
        return access is not None and access != "readwrite"

    # ---- connection -------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Open the connection and send HELLO now (otherwise the first request does): a caller with a tight
        per-request timeout pays the handshake ahead of time."""
        self._t.connect()

    def settimeout(self, seconds: float) -> None:
        """The per-operation timeout from now on, the open connection's included."""
        with self._t.lock:
            self._t.settimeout(seconds)

    def close(self) -> None:
        with self._t.lock:
            self._t.close()

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- single sequences ---------------------------------------------------------------------------------------
    def lookup(self, tokens) -> int:
        """How many leading tokens of `tokens` the cache holds.

        Returns: the cached token count (0: a miss).
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails.
        """
        return self._t.call(Opcode.LOOKUP, [_as_int32(tokens)]).num_cached[0]

    def events(self, since: int = 0, *, max_batches: int = 256) -> CacheEvents:
        """The cache's block events from batch `since` on (vLLM's KV-event format, kcaas.kv_events): which full
        blocks entered and left the node's device pool, in order. Read again from `next_seq` for what follows;
        `missed` says batches before `first_seq` are gone (start over from an empty view: resync with lookups).

        Returns: CacheEvents(first_seq, next_seq, batches [(seq, EventBatch)], missed).
        Raises: DataPlaneError (its `code`: not_found, token_expired, ...) when the node refuses; OSError when the
            connection fails.
        """
        from kcaas.kv_events import decode_batch

        answer = self._t.call_events(since, max_batches)
        batches = tuple((seq, decode_batch(payload)) for seq, payload in answer.batches)
        return CacheEvents(answer.first_seq, answer.next_seq, batches, missed=since < answer.first_seq)

    def delete(self, tokens) -> int:
        """Forget the cached prefix of `tokens` and everything stored under it; returns the blocks removed.

        Returns: the blocks removed (0: nothing cached).
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails. forbidden for a read token.
        """
        return self.delete_batch([tokens])[0]

    def put(self, tokens, kv, *, start: int = 0) -> dict:
        """Store the KV of every token of `tokens` (kv: [num_layers, 2, n, num_kv_heads, head_dim], spec.kv_dtype).

        `start`: kv holds tokens[start:] only (n - start tokens), the cache already holding tokens[:start] (a node
        that no longer does refuses with `prefix_not_cached`). Returns {"num_cached", "num_written",
        "out_of_space"}; a sequence larger than a frame goes in several frames, each appended after the last.

        Returns: {"num_cached", "num_written", "out_of_space"}.
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails. forbidden for a read token; prefix_not_cached (with
            `start`).
        """
        return self.put_batch([(tokens, kv, start)])[0]

    def get(self, tokens, *, out=None, start: int = 0, progress=None):
        """(n, kv): the longest cached prefix of `tokens` and its KV [num_layers, 2, n, num_kv_heads, head_dim].

        `start`: only the KV of tokens[start:n] is sent (a caller that holds the first `start` tokens' KV itself);
        kv then has n - start tokens, and n < start when not even tokens[:start] are cached (kv is empty).
        `out`: an optional reusable staging tensor (contiguous, CPU, the kv dtype, room for len(tokens) - start
        tokens): the answer — every part of a long one at its offset — is received straight into it and kv is a view
        of it: no fresh buffer per get (its page faults cost more than the transfer). Without it, each get allocates
        one buffer for its result.

        `progress(layers, tokens)`: with `out`, called on this thread while the answer arrives, once every layer
        below `layers` holds its final KV for the answer's `tokens` tokens in `out` (layer-major: layer i's K and V
        of every token), so another thread may read those layers of `out` before get returns (a layer-pipelined
        load). Only for the part that completes the answer (a long answer in several frames: its last one).

        Returns: (n, kv); n 0 and kv empty on a miss.
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails. ValueError for an unusable `out` or `start`.
        """
        if progress is not None and out is None:
            raise ValueError("progress needs an out tensor: the layers it reports are read there")
        return self.get_batch([tokens], outs=[out], starts=[start], progress=progress)[0]

    # ---- batches ------------------------------------------------------------------------------------------------
    def lookup_batch(self, sequences) -> list[int]:
        """lookup of each sequence, in as few round trips as the node's frame limits allow (usually one).

        Returns: one cached token count per sequence.
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails.
        """
        ids = [_as_int32(t) for t in sequences]
        return self._token_only(Opcode.LOOKUP, ids, lambda reply: reply.num_cached)

    def delete_batch(self, sequences) -> list[int]:
        """delete of each sequence (in order), in as few round trips as the frame limits allow.

        Returns: the blocks removed per sequence.
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails.
        """
        ids = [_as_int32(t) for t in sequences]
        return self._token_only(Opcode.DELETE, ids, lambda reply: reply.num_removed_blocks)

    def get_batch(self, sequences, *, outs=None, starts=None, progress=None) -> list:
        """get of each sequence: [(n, kv), ...]. outs[i] / starts[i] as get's `out` / `start` (None / 0).

        Returns: one (n, kv) per sequence.
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails. ValueError for mismatched `outs`/`starts`.
        """
        import torch

        spec = self.identity
        ids = [_as_int32(t) for t in sequences]
        starts = [int(s) for s in starts] if starts is not None else [0] * len(ids)
        outs = list(outs) if outs is not None else [None] * len(ids)
        if not len(starts) == len(outs) == len(ids):
            raise ValueError("one start and one out per sequence")
        dtype = getattr(torch, _TORCH_DTYPES[spec.kv_dtype])
        for seq, start in zip(ids, starts):
            if not 0 <= start <= len(seq):
                raise ValueError(f"start must be within 0..{len(seq)}")
        states = [
            Received(self._out_bytes(out, dtype, len(seq) - start), start, len(seq), spec, out, self._views)
            for out, seq, start in zip(outs, ids, starts)
        ]
        if progress is not None:
            if len(states) != 1:
                raise ValueError("progress streams one sequence's answer: get, not a batch")
            states[0].progress = progress
        with self._t.lock, streaming(self._t, states[0] if progress is not None else None):
            pending = list(range(len(ids)))
            while pending:
                for chunk in self._chunks(pending, ids) if len(pending) > 1 else (pending,):
                    reply = self._t.call(
                        Opcode.GET if len(chunk) == 1 else Opcode.GET_BATCH,
                        [ids[i] for i in chunk],
                        kv_start=[states[i].next_token for i in chunk],
                        receive_into=[states[i] for i in chunk],
                    )
                    for slot, i in enumerate(chunk):
                        sent = reply.kv_end[slot] - reply.kv_start[slot]
                        states[i].arrived(reply.num_cached[slot], sent)
                        if len(chunk) == 1 and sent <= 0:
                            states[i].wants_more = False  # alone in a frame and still nothing: the node cannot
                # a part cut short by the node's frame limit continues from where it stopped
                pending = [i for i in pending if states[i].wants_more]
        return [state.result(dtype) for state in states]

    def put_batch(self, items) -> list[dict]:
        """put of each (tokens, kv) or (tokens, kv, start): [{"num_cached", "num_written", "out_of_space"}, ...].
        Sequences are packed into frames up to the node's limit (one round trip for a batch that fits); one larger
        than a frame is sent alone, in parts.

        Returns: one put answer per item.
        Raises: DataPlaneError (its `code`: not_found, forbidden, token_expired, identity_mismatch, overloaded, ...)
        when the
            node refuses; OSError when the connection fails.
        """
        prepared = [self._prepare_put(*item) for item in items]
        results: list = [None] * len(prepared)
        with self._t.lock:
            self._t.connect()  # the node's frame limit is known after HELLO
            per_frame = self._t.max_frame_bytes - wire.HEADER_SIZE - _FRAME_SLACK
            small = [i for i, (ids, kv, start) in enumerate(prepared) if _put_bytes(ids, kv, start) <= per_frame]
            for i in range(len(prepared)):
                if i not in small:
                    results[i] = self._put_long(*prepared[i])
            for chunk in self._chunks(small, [p[0] for p in prepared], put=prepared):
                reply = self._t.call(
                    Opcode.PUT if len(chunk) == 1 else Opcode.PUT_BATCH,
                    [prepared[i][0] for i in chunk],
                    kv=[_kv_bytes(prepared[i][1]) for i in chunk],
                    kv_start=[prepared[i][2] for i in chunk],
                )
                for slot, i in enumerate(chunk):
                    results[i] = {
                        "num_cached": reply.num_cached[slot],
                        "num_written": reply.num_written[slot],
                        "out_of_space": reply.out_of_space[slot],
                    }
        return results

    # ---- plumbing ---------------------------------------------------------------------------------------------------
    def _token_only(self, opcode: Opcode, ids: list, field) -> list[int]:
        out: list[int] = [0] * len(ids)
        with self._t.lock:
            for chunk in self._chunks(list(range(len(ids))), ids):
                batch = Opcode(opcode | BATCH_BIT) if len(chunk) > 1 else opcode
                reply = self._t.call(batch, [ids[i] for i in chunk])
                for slot, i in enumerate(chunk):
                    out[i] = field(reply)[slot]
        return out

    def _chunks(self, indexes: list[int], ids: list, *, put: list | None = None):
        """Consecutive runs of `indexes` that fit one frame: at most MAX_BATCH_SIZE sequences, their token ids (and
        a put's KV) within max_frame_bytes, their counts within the metadata limit."""
        t = self._t
        if t.hello is None:
            t.connect()
        budget = t.max_frame_bytes - wire.HEADER_SIZE - _FRAME_SLACK
        meta_budget = t.max_metadata_bytes - 1024
        chunk: list[int] = []
        size = meta = 0
        for i in indexes:
            cost = 4 * len(ids[i]) + (_put_bytes(*put[i]) - 4 * len(ids[i]) if put is not None else 0)
            if chunk and (len(chunk) == wire.MAX_BATCH_SIZE or size + cost > budget or meta + 48 > meta_budget):
                yield chunk
                chunk, size, meta = [], 0, 0
            chunk.append(i)
            size += cost
            meta += 48  # a few integers of up to 20 digits per sequence
        if chunk:
            yield chunk

    def _out_bytes(self, out, dtype, num_tokens: int):
        """The writable bytes of a caller's `out` (checked), remembered for the next get into the same tensor."""
        if out is None:
            return None
        known = self._views.get(("bytes", id(out)))
        if known is not None and known[0] is out and known[1] >= num_tokens:
            return known[2]
        view = _staging_view(out, dtype, num_tokens, self.identity)
        room = out.numel() // self.identity.elements_per_token
        self._views.put(("bytes", id(out)), (out, room, view))
        return view

    def _prepare_put(self, tokens, kv, start: int = 0):
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
        return ids, kv, int(start)

    def _put_long(self, ids, kv, first: int) -> dict:
        """One sequence in several frames, each carrying only its own tokens' KV: appended after what the node holds
        (a prefix it evicted between frames is sent again from what it still holds, a few times at most)."""
        spec, n = self.identity, len(ids)
        per_frame = max(
            1, (self._t.max_frame_bytes - wire.HEADER_SIZE - _FRAME_SLACK - 4 * n) // spec.kv_bytes_per_token
        )
        start, written, retries = first, 0, 0
        num_cached, out_of_space = n, False  # what nothing to send answers
        while start < n:
            end = min(n, start + per_frame)
            try:
                reply = self._t.call(
                    Opcode.PUT, [ids[:end]], kv=[_kv_bytes(kv[:, :, start - first : end - first])], kv_start=[start]
                )
            except DataPlaneError as exc:
                held = exc.details.get("num_cached") if exc.code == ErrorCode.PREFIX_NOT_CACHED else None
                if not isinstance(held, int) or held < first or held >= start or retries >= _MAX_PREFIX_RETRIES:
                    raise
                retries += 1
                start = held  # evicted under us: resend from what the node still holds (kv covers it)
                continue
            written += reply.num_written[0]
            num_cached, out_of_space = reply.num_cached[0], reply.out_of_space[0]
            if out_of_space or num_cached < end:
                break
            start = end
        return {"num_cached": num_cached, "num_written": written, "out_of_space": out_of_space}


def _put_bytes(ids, kv, start: int) -> int:
    return 4 * len(ids) + kv.numel() * kv.element_size()


def _kv_bytes(kv):
    """The tensor's bytes in C order, without a copy: one view when it is contiguous, else one per (layer, K|V) run
    (a token range of a contiguous [layers, 2, tokens, heads, dim] tensor, as the frames of a long put send)."""
    import torch

    if kv.is_contiguous():
        return memoryview(kv.view(torch.uint8).reshape(-1).numpy())
    if kv[0, 0].is_contiguous():
        return [memoryview(run.view(torch.uint8).reshape(-1).numpy()) for run in kv.reshape(-1, *kv.shape[2:])]
    return memoryview(kv.contiguous().view(torch.uint8).reshape(-1).numpy())


def _staging_view(out, dtype, num_tokens: int, spec: KVCacheSpec):
    if out is None:
        return None
    if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous CPU tensor of {dtype}")
    if out.numel() < num_tokens * spec.elements_per_token:
        raise ValueError(f"out must have room for {num_tokens} tokens of KV")
    import torch

    return memoryview(out.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes, writable


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
