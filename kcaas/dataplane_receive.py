"""Where a GET's answer lands, for kcaas.dataplane's client: each sequence's receiver (laid out part by part in one
buffer, reporting a streamed answer's layers as they arrive), the client's memo of recent result views, and the
switch that has the transport report a streaming GET's payload bytes. No torch at import."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kcaas.dataplane_transport import Transport
from kcaas.spec import KVCacheSpec

_UNBOUNDED = 1 << 62  # no report due: read on


@contextmanager
def streaming(transport: Transport, state: Received | None) -> Iterator[None]:
    """While a GET with progress is in flight, the transport tells its receiver the payload bytes as they arrive
    (before each read into the payload) and reads no further than the next layer the receiver reports."""
    transport.on_payload = state.on_payload if state is not None else None
    try:
        yield
    finally:
        transport.on_payload = None


class Received:
    """Where one sequence's GET answer goes, part by part. Its KV is laid out [num_layers, 2, total, heads, dim] in
    one buffer — the caller's `out`, else one allocated when the first answer says how long the cached prefix is
    (`total`, fixed then) — and each part of tokens [a, b) lands at token a of every (layer, K|V) run: parts of a
    long GET are neither joined nor copied. A one-part answer is a single view. Tokens the cache gained between
    parts beyond `total` are dropped (the result is the prefix the first answer promised); if it lost some, the
    result is what arrived."""

    def __init__(self, out_view, start: int, bound: int, spec: KVCacheSpec, out=None, recent=None):
        self.spec, self.start, self.bound = spec, start, bound
        self.progress = None  # progress(layers, tokens) of get: told as the part that completes the answer arrives
        self._layer_bytes = 0  # bytes of one layer (K and V) of that part; 0 for any other part
        self._layers_told = 0  # the layers progress was last told of (for that part)
        self.out, self.recent = out, recent  # the caller's tensor (out_view is its bytes), and the client's memo
        self.buffer = out_view  # None until the first answer when the caller gave no out
        self.total: int | None = None  # tokens of KV the buffer is laid out for (set by the first answer)
        self.num_received = 0
        self.num_cached = 0
        self._fit = 0  # tokens of the part in flight that land in the buffer
        self.wants_more = False

    @property
    def next_token(self) -> int:
        return self.start + self.num_received

    def views_for(self, num_cached: int, kv_start: int, kv_end: int) -> list[memoryview]:
        """Called by the transport's payload sink with the answer's metadata: where this part's bytes go."""
        spec, n = self.spec, max(kv_end - kv_start, 0)
        if self.total is None:
            self.total = max(min(num_cached, self.bound) - self.start, n)
            if self.buffer is None:
                self.buffer = memoryview(bytearray(self.total * spec.kv_bytes_per_token))
        total, at = self.total, self.num_received
        fit = self._fit = max(min(n, total - at), 0)
        run = spec.kv_bytes_per_token // (2 * spec.num_layers)  # one token of one (layer, K|V) run
        self._layer_bytes = 2 * n * run if n and at + fit >= total else 0  # this part completes the answer
        self._layers_told = 0
        if fit == n == total and at == 0:
            return [self.buffer[: total * spec.kv_bytes_per_token]]  # the whole answer at once: one view
        views = []
        for index in range(2 * spec.num_layers):
            if fit:
                offset = (index * total + at) * run
                views.append(self.buffer[offset : offset + fit * run])
            if n > fit:
                views.append(memoryview(bytearray((n - fit) * run)))  # beyond what the first answer promised
        return views

    def on_payload(self, received: int) -> int:
        """The transport's count of the answer's payload bytes so far: layers whose bytes are all in are reported
        (once each: progress is told only when the count grows). Returns the bytes the transport may read before
        the next layer is in (it tells this receiver again then)."""
        step = self._layer_bytes
        if self.progress is None or not step:
            return _UNBOUNDED
        layers = min(received // step, self.spec.num_layers)
        if layers > self._layers_told:
            self._layers_told = layers
            self.progress(layers, self.total)
        return step - received % step

    def arrived(self, num_cached: int, num_tokens: int) -> None:
        fit = self._fit if num_tokens > 0 else 0
        self._fit, self._layer_bytes = 0, 0  # the part is in: nothing more of it to report
        self.num_received += fit
        self.num_cached = num_cached
        # more of the promised prefix to come: a frame limit cut this part short (or, in a batch, left it no room)
        self.wants_more = self.next_token < num_cached and (self.total is None or self.num_received < self.total)

    def result(self, dtype):
        import torch

        spec, n = self.spec, self.num_received
        if n == 0:
            empty = torch.empty((spec.num_layers, 2, 0, spec.num_kv_heads, spec.head_dim), dtype=dtype)
            return min(self.num_cached, self.start), empty
        total = self.total
        assert total is not None, "the first answer sets total before any token arrives"
        key = ("result", id(self.out), total)
        if n == total and self.out is not None:  # the same view of the same out as last time: made once
            known = self.recent.get(key)
            if known is not None and known[0] is self.out:
                return self.next_token, known[1]
        flat = torch.frombuffer(self.buffer, dtype=dtype, count=total * spec.elements_per_token)
        kv = flat.view(spec.num_layers, 2, total, spec.num_kv_heads, spec.head_dim)
        if n < total:  # the cache lost tokens between parts: what arrived, packed (rare)
            return self.next_token, kv[:, :, :n].contiguous()
        if self.out is not None:
            self.recent.put(key, (self.out, kv))
        return self.next_token, kv


class Recent:
    """A few remembered values (the client's views of its caller's recent `out` tensors): the oldest goes first."""

    def __init__(self, size: int = 8):
        self.size = size
        self.items: dict[Any, Any] = {}

    def get(self, key):
        return self.items.get(key)

    def put(self, key, value) -> None:
        if key not in self.items and len(self.items) >= self.size:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value
