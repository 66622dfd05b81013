"""An engine's queue as it reports it: vLLM's Prometheus gauges `vllm:num_requests_waiting` and
`vllm:num_requests_running` (summed over their label sets: one per engine core or model) from its `/metrics`. The
indexer's health loop reads them; a lookup answers them beside each instance's used blocks. An engine that does not
report them (another server, or a scrape that failed) has an unknown queue (None), never a made-up 0."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

MAX_METRICS_BYTES = 4 << 20  # a /metrics answer longer than this is cut (the gauges come early in vLLM's)
_SAMPLE = re.compile(r"^(vllm:num_requests_(?:waiting|running))(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)(?:\s+\d+)?$")


@dataclass(frozen=True)
class EngineQueue:
    waiting: int | None
    running: int | None


def parse_queue(text: str) -> EngineQueue:
    """The two gauges from Prometheus text exposition; a gauge with no sample is None."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match and match.group(2) != "NaN":
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(2))

    def gauge(name: str) -> int | None:
        value = totals.get(f"vllm:num_requests_{name}")
        return None if value is None else max(0, round(value))

    return EngineQueue(gauge("waiting"), gauge("running"))


def read_queue(api_base: str, timeout_s: float) -> EngineQueue:
    """The engine's queue from its /metrics; unknown (None, None) when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{api_base}/metrics", timeout=timeout_s) as answer:
            text = answer.read(MAX_METRICS_BYTES).decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return EngineQueue(None, None)
    return parse_queue(text)
