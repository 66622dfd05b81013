"""bench.hit_cost's stage clock and its node process: wrappers that time named functions of a live process (a GET's
lookup, block reads, framing and TLS send on the node; its request, answer head, payload and result in the client),
the instrumented node process, and the arithmetic that turns one GET's recorded calls into stages.

A call's span is taken with time.perf_counter_ns (CLOCK_MONOTONIC: comparable between the processes of one machine,
so the node's and the client's spans fall on one timeline) and its thread's CPU time with time.thread_time_ns (CPU
spent, against wall time waited). The wrappers cost ~1 us a call and sit on a handful of calls per GET, none per
record. Not a benchmark of its own (`make bench` skips bench/_*.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from bench._dataplane_node import NodeProcess, node_main

Call = tuple[str, int, int, int]  # (stage, start ns, end ns, thread CPU ns)


class Probe:
    """Times calls of wrapped functions; `take()` hands over (and forgets) the calls recorded so far."""

    def __init__(self) -> None:
        self._calls: list[Call] = []
        self._originals: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, stage: str) -> None:
        """Replace owner.name (a module's function or a class's method) with a timed wrapper recording `stage`."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        self._originals.append((owner, name, original))
        probe = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                probe._calls.append((stage, t0, time.perf_counter_ns(), time.thread_time_ns() - c0))

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Every wrapped function back as it was."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def take(self) -> list[Call]:
        calls, self._calls = self._calls, []
        return calls


# ---- the node side --------------------------------------------------------------------------------------------------
def install_node_probes(probe: Probe) -> None:
    """The node's GET path, by stage: the request's check before its payload (`check`), the whole handling
    (`handle`), the hash chain and prefix walk (`lookup`), the block reads (`block_views`: views of the pool, or
    `block_read` into staging for a device or quantized pool), the answer's framing (`framing`), the TLS
    encryption and send (`send`) and what follows it (`answered`: release, billing, metrics)."""
    import gpu_node.dataplane.server as server
    from gpu_node.dataplane.requests import RequestHandler
    from gpu_node.engine.paged_cache import PagedKVCache
    from kcaas import wire

    probe.wrap(RequestHandler, "sink", "check")
    probe.wrap(RequestHandler, "handle", "handle")
    probe.wrap(RequestHandler, "answered", "answered")
    probe.wrap(PagedKVCache, "acquire", "lookup")
    probe.wrap(PagedKVCache, "kv_views", "block_views")
    probe.wrap(PagedKVCache, "read", "block_read")
    probe.wrap(wire, "encode_get_ok", "framing")
    probe.wrap(server, "send_buffers", "send")


class _StagesPipe:
    """node_main's pipe, answering "stages" (the calls recorded since the last ask) until any other message."""

    def __init__(self, conn, probe: Probe):
        self.conn, self.probe = conn, probe

    def send(self, obj) -> None:
        self.conn.send(obj)

    def recv(self):
        while True:
            message = self.conn.recv()
            if message != "stages":
                return message
            self.conn.send(self.probe.take())


def probed_node_main(conn, pki: dict, jwks: dict, workdir: str, config: dict) -> None:
    """bench._dataplane_node.node_main with the node's GET path timed (install_node_probes)."""
    probe = Probe()
    install_node_probes(probe)
    node_main(_StagesPipe(conn, probe), pki, jwks, workdir, config)


class ProbedNode(NodeProcess):
    """A NodeProcess whose GET path is timed: `stages()` returns the calls it recorded since the last ask."""

    def __init__(self, ctx, pki: dict, jwks: dict, workdir: str, config: dict):
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=probed_node_main, args=(child, pki, jwks, workdir, config), daemon=True)
        self.process.start()
        if not self._conn.poll(180):
            raise SystemExit("bench.hit_cost: the node process did not start within 180 s")
        self.info = self._conn.recv()

    def stages(self) -> list[Call]:
        self._conn.send("stages")
        return self._conn.recv()


# ---- the client side ------------------------------------------------------------------------------------------------
def install_client_probes(probe: Probe) -> None:
    """The SDK's GET path: the request's encoding and send, the answer's head (metadata in, views chosen), the
    frame read (head and payload: TLS recv and decrypt into `out`), the answer's parse and the result's views."""
    from kcaas import wire
    from kcaas.dataplane_receive import Received
    from kcaas.dataplane_transport import Transport

    probe.wrap(wire, "encode_request", "request_encode")
    probe.wrap(Transport, "_send", "request_send")
    probe.wrap(Received, "views_for", "answer_head")  # called by the transport's sink once the metadata is in
    probe.wrap(Transport, "_read_frame", "read_frame")
    probe.wrap(wire, "parse_response", "parse")
    probe.wrap(Received, "result", "result")


# ---- one GET's stages -----------------------------------------------------------------------------------------------
def _by_stage(calls: list[Call]) -> dict[str, tuple[int, int, int, int]]:
    """stage -> (first start, last end, summed wall, summed CPU), in ns."""
    found: dict[str, tuple[int, int, int, int]] = {}
    for stage, t0, t1, cpu in calls:
        first, last, wall, used = found.get(stage, (t0, t1, 0, 0))
        found[stage] = (min(first, t0), max(last, t1), wall + t1 - t0, used + cpu)
    return found


def _ms(ns: float) -> float:
    return ns / 1e6


def node_stages(calls: list[Call]) -> dict[str, float]:
    """One GET's node stages in ms: check, lookup, block reads, framing, the rest of handling (authorization,
    dispatch, the tenant's budget), TLS encrypt + send (wall and CPU), after the send."""
    s = _by_stage(calls)

    def wall(name: str) -> int:
        return s[name][2] if name in s else 0

    inner = wall("lookup") + wall("block_views") + wall("block_read") + wall("framing")
    return {
        "check": _ms(wall("check")),
        "lookup": _ms(wall("lookup")),
        "block_reads": _ms(wall("block_views") + wall("block_read")),
        "framing": _ms(wall("framing")),
        "handle_other": _ms(max(wall("handle") - inner, 0)),
        "tls_send": _ms(wall("send")),
        "tls_send_cpu": _ms(s["send"][3]) if "send" in s else 0.0,
        "after_send": _ms(wall("answered")),
    }


def client_stages(calls: list[Call], started_ns: int, ended_ns: int) -> dict[str, float]:
    """One GET's client stages in ms, between `started_ns` and `ended_ns` (the get call): building and sending the
    request, waiting for the answer's first bytes (the node's work and the wire), the head's metadata, TLS recv and
    decrypt straight into `out` (wall and this thread's CPU), parse, the result's views, and the Python left."""
    s = _by_stage(calls)
    encode, send, head, read = s["request_encode"], s["request_send"], s["answer_head"], s["read_frame"]
    parse = s["parse"][2] if "parse" in s else 0
    result = s["result"][2] if "result" in s else 0
    stages = {
        "request": _ms(encode[2] + send[2]),
        "wait_first_bytes": _ms(max(head[0] - send[1], 0)),
        "answer_head": _ms(head[2]),
        "recv_decrypt_into_out": _ms(max(read[1] - head[1], 0)),
        "recv_decrypt_cpu": _ms(read[3]),
        "parse": _ms(parse),
        "result_views": _ms(result),
    }
    counted = sum(v for k, v in stages.items() if k != "recv_decrypt_cpu")
    stages["python_other"] = max(_ms(ended_ns - started_ns) - counted, 0.0)
    return stages


def run_probed(probe: Probe, fn: Callable[[], Any]) -> tuple[int, int]:
    """fn() with the probe's calls cleared first: (start ns, end ns) of the call."""
    probe.take()
    started = time.perf_counter_ns()
    fn()
    return started, time.perf_counter_ns()
