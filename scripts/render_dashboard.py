"""Render a Grafana dashboard's panels (deploy/grafana/*.json) from a live platform's /metrics, without Grafana or
Prometheus: scrape the control plane and the node agents every few seconds for a short run, evaluate each panel's
PromQL on those scrapes, draw the panels as SVG in one HTML page and screenshot it with headless chromium.

    scripts/render_dashboard.py --control-url http://127.0.0.1:8000 --node-url http://127.0.0.1:8101 \
        [--token T] [--api-key KEY] [--seconds 90] [--dashboard deploy/grafana/fleet.json] \
        [--out docs/observability/fleet.png]

It is a rendering of the dashboard's queries, not Grafana. The evaluator knows the PromQL the dashboards use and no
more: selectors with = and =~ matchers, rate/increase over the scrapes inside the range (no extrapolation),
sum [by (...)], histogram_quantile, clamp_min, time(), and + - / between vectors with the same labels or a single
value. --api-key makes light traffic while it scrapes (cache attaches, one too large for any node, listings,
unauthenticated calls) so the request and attach panels have something to show.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
COLORS = ("#3274d9", "#e02f44", "#56a64b", "#ff9830", "#a352cc", "#8ab8ff", "#f2cc0c", "#5794f2", "#fade2a")
SELECTOR = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?(\[(\d+)([smhd])\])?$")
MATCHER = re.compile(r'\s*([a-zA-Z_]+)\s*(=~|=)\s*"([^"]*)"\s*,?')
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

Labels = tuple  # sorted (name, value) pairs


# ---- scraping ------------------------------------------------------------------------------------------------------
def scrape(urls: list[str], token: str) -> list[tuple[str, dict, float]]:
    samples = []
    for url in urls:
        request = urllib.request.Request(url.rstrip("/") + "/metrics")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        instance = url.split("://", 1)[-1].rstrip("/")
        for family in text_string_to_metric_families(text):
            samples.extend((s.name, {**s.labels, "instance": instance}, s.value) for s in family.samples)
    return samples


# ---- the PromQL subset ----------------------------------------------------------------------------------------------
def split_top(expr: str, op: str) -> tuple[str, str] | None:
    """The last top-level ` op ` (outside brackets), so a - b - c groups as (a - b) - c."""
    depth, at = 0, None
    for index, char in enumerate(expr):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0 and expr.startswith(f" {op} ", index):
            at = index
    return (expr[:at], expr[at + len(op) + 2 :]) if at is not None else None


def call_args(expr: str, name: str) -> list[str] | None:
    if not (expr.startswith(name + "(") and expr.endswith(")")):
        return None
    inner, parts, depth, start = expr[len(name) + 1 : -1], [], 0, 0
    for index, char in enumerate(inner):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth < 0:
            return None  # the closing parenthesis is not this call's
        if char == "," and depth == 0:
            parts.append(inner[start:index].strip())
            start = index + 1
    return [*parts, inner[start:].strip()]


class Evaluator:
    def __init__(self, history: list[tuple[float, list]]):
        self.history = history

    def at(self, expr: str, index: int) -> dict[Labels, float]:
        expr = expr.strip()
        for op in ("/", "-", "+"):
            parts = split_top(expr, op)
            if parts:
                return self._binary(op, self.at(parts[0], index), self.at(parts[1], index))
        if expr.startswith("(") and call_args("x" + expr, "x") is not None:
            return self.at(expr[1:-1], index)
        if expr == "time()":
            return {(): self.history[index][0]}
        if re.fullmatch(r"[0-9.e-]+", expr):
            return {(): float(expr)}
        for name in ("rate", "increase"):
            args = call_args(expr, name)
            if args:
                return self._range(name, args[0], index)
        args = call_args(expr, "clamp_min")
        if args:
            floor = float(args[1])
            return {labels: max(value, floor) for labels, value in self.at(args[0], index).items()}
        args = call_args(expr, "histogram_quantile")
        if args:
            return quantiles(float(args[0]), self.at(args[1], index))
        grouped = re.match(r"^sum(?: by \(([^)]*)\))?\s*\((.*)\)$", expr, re.S)
        if grouped:
            keep = [name.strip() for name in (grouped.group(1) or "").split(",") if name.strip()]
            return summed(self.at(grouped.group(2), index), keep)
        return self._select(expr, index)

    def _select(self, expr: str, index: int) -> dict[Labels, float]:
        match = SELECTOR.match(expr)
        if match is None:
            raise ValueError(f"outside the rendered PromQL subset: {expr}")
        matchers = MATCHER.findall(match.group(3) or "")
        found = {}
        for name, labels, value in self.history[index][1]:
            if name == match.group(1) and all(_matches(labels.get(k, ""), op, v) for k, op, v in matchers):
                found[tuple(sorted(labels.items()))] = value
        return found

    def _range(self, function: str, selector: str, index: int) -> dict[Labels, float]:
        match = SELECTOR.match(selector)
        if match is None or match.group(4) is None:
            raise ValueError(f"a range selector was expected: {selector}")
        window = int(match.group(5)) * UNITS[match.group(6)]
        instant = selector[: selector.index("[")]
        now = self.history[index][0]
        inside = [i for i in range(index + 1) if self.history[i][0] >= now - window]
        first, last = self._select(instant, inside[0]), self._select(instant, index)
        elapsed = now - self.history[inside[0]][0]
        result = {}
        for labels, value in last.items():
            grown = max(0.0, value - first.get(labels, value))
            result[labels] = grown if function == "increase" else (grown / elapsed if elapsed > 0 else 0.0)
        return result

    @staticmethod
    def _binary(op: str, left: dict, right: dict) -> dict[Labels, float]:
        def apply(a: float, b: float) -> float:
            return a / b if op == "/" and b else (a - b if op == "-" else a + b if op == "+" else float("nan"))

        if len(right) == 1 and () in right:
            return {labels: apply(value, right[()]) for labels, value in left.items()}
        if len(left) == 1 and () in left:
            return {labels: apply(left[()], value) for labels, value in right.items()}
        strip = {labels: dict(labels) for labels in right}
        return {labels: apply(value, right[labels]) for labels, value in left.items() if labels in strip}


def _matches(actual: str, op: str, wanted: str) -> bool:
    return actual == wanted if op == "=" else re.fullmatch(wanted, actual) is not None


def summed(vector: dict[Labels, float], keep: list[str]) -> dict[Labels, float]:
    groups: dict[Labels, float] = {}
    for labels, value in vector.items():
        key = tuple((k, v) for k, v in labels if k in keep)
        groups[key] = groups.get(key, 0.0) + value
    return groups


def quantiles(q: float, buckets: dict[Labels, float]) -> dict[Labels, float]:
    series: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        rest = tuple((k, v) for k, v in labels if k != "le")
        series.setdefault(rest, []).append((float(dict(labels)["le"]), count))
    result = {}
    for labels, points in series.items():
        points.sort()
        total = points[-1][1]
        if total <= 0:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for bound, count in points:
            if count >= rank:
                fraction = (rank - below) / (count - below) if count > below else 0.0
                result[labels] = bound if bound == float("inf") else lower + (bound - lower) * fraction
                if bound == float("inf"):
                    result[labels] = lower
                break
            lower, below = bound, count
    return result


def legend(template: str, labels: Labels) -> str:
    values = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: values.get(m.group(1), ""), template) or "value"


# ---- drawing --------------------------------------------------------------------------------------------------------
def panel_series(panel: dict, evaluator: Evaluator) -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = {}
    for target in panel["targets"]:
        for index, (at, _) in enumerate(evaluator.history):
            if index == 0 and "[" in target["expr"]:
                continue  # a range needs two scrapes
            for labels, value in evaluator.at(target["expr"], index).items():
                lines.setdefault(legend(target.get("legendFormat", ""), labels), []).append((at, value))
    return lines


def fmt(value: float, unit: str) -> str:
    if unit == "bytes":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024:
                return f"{value:.3g} {suffix}"
            value /= 1024
    if unit == "percentunit":
        return f"{100 * value:.3g}%"
    suffix = {"s": " s", "reqps": " req/s", "ops": " /s", "Bps": " B/s"}.get(unit, "")
    return f"{value:.3g}{suffix}"


def svg_panel(panel: dict, lines: dict, start: float, end: float) -> str:
    width, height, left, top = 560, 250, 70, 30
    plot_w, plot_h = width - left - 20, height - top - 70
    values = [v for points in lines.values() for _, v in points] or [0.0]
    low, high = min(0.0, min(values)), max(values)
    high = high if high > low else low + 1
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    out = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">']
    out.append(f'<rect width="{width}" height="{height}" fill="#181b1f" rx="4"/>')
    out.append(f'<text x="10" y="20" fill="#ccccdc" font-size="14">{html.escape(panel["title"])}</text>')
    for step in range(5):
        y = top + plot_h - plot_h * step / 4
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y}" y2="{y}" stroke="#2c3235"/>')
        label = fmt(low + (high - low) * step / 4, unit)
        out.append(f'<text x="{left - 6}" y="{y + 4}" fill="#8e8e8e" font-size="10" text-anchor="end">{label}</text>')
    span = max(end - start, 1e-9)
    for number, (name, points) in enumerate(sorted(lines.items())[: len(COLORS)]):
        color = COLORS[number]
        coords = " ".join(
            f"{left + plot_w * (t - start) / span:.1f},{top + plot_h - plot_h * (v - low) / (high - low):.1f}"
            for t, v in points
        )
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        x, y = 10 + (number % 3) * 180, height - 40 + (number // 3) * 14
        out.append(f'<rect x="{x}" y="{y - 8}" width="10" height="3" fill="{color}"/>')
        out.append(f'<text x="{x + 14}" y="{y - 4}" fill="#ccccdc" font-size="10">{html.escape(name[:30])}</text>')
    if not lines:
        out.append(f'<text x="{width / 2}" y="{height / 2}" fill="#8e8e8e" text-anchor="middle">No data</text>')
    out.append("</svg>")
    return "".join(out)


def page(dashboard: dict, history: list, sources: list[str]) -> str:
    evaluator = Evaluator(history)
    start, end = history[0][0], history[-1][0]
    panels = "".join(svg_panel(p, panel_series(p, evaluator), start, end) for p in dashboard["panels"])
    note = (
        f"A rendering of the queries of deploy/grafana/{html.escape(dashboard['uid'].removeprefix('kcaas-'))}.json, "
        f"evaluated by scripts/render_dashboard.py on {len(history)} scrapes over {end - start:.0f} s of "
        f"{html.escape(', '.join(sources))}: not Grafana."
    )
    return (
        '<!doctype html><html><body style="background:#111217;margin:12px;font-family:sans-serif">'
        f'<h2 style="color:#ccccdc;margin:4px">{html.escape(dashboard["title"])}</h2>'
        f'<p style="color:#8e8e8e;margin:4px 4px 10px">{note}</p>'
        f'<div style="display:grid;grid-template-columns:repeat(2,560px);gap:8px">{panels}</div></body></html>'
    )


# ---- traffic and the run --------------------------------------------------------------------------------------------
def traffic(control_url: str, api_key: str, step: int) -> None:
    """Light, real requests: listings, an unauthenticated call, and now and then an attach (one too large)."""
    spec = {
        "model_fingerprint": "render-dashboard@1",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "block_size": 16,
        "kv_dtype": "float16",
        "storage_dtype": "float16",
    }
    calls = [("GET", "/api/v1/caches", None, api_key), ("GET", "/api/v1/whoami", None, "")]
    if step % 5 == 0:
        device = 4 * 2**30 if step % 10 == 0 else 64 * 2048  # 4 GiB: within the quota, more than a dev node
        body = {"name": f"render-{step}-{int(time.time())}", "spec": spec, "capacity": {"device": device}}
        calls.append(("POST", "/api/v1/caches", body, api_key))
    for method, path, body, key in calls:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(control_url.rstrip("/") + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            urllib.request.urlopen(request, timeout=10).read()
        except urllib.error.HTTPError as refused:
            refused.read()  # 401 and 503 no_capacity are part of the picture


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-url", required=True)
    parser.add_argument("--node-url", action="append", default=[])
    parser.add_argument("--token", default="", help="the control plane's KCAAS_METRICS_TOKEN, if set")
    parser.add_argument("--api-key", default="", help="a tenant key for light traffic during the run")
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--interval", type=float, default=3)
    parser.add_argument("--dashboard", default=str(REPO / "deploy" / "grafana" / "fleet.json"))
    parser.add_argument("--out", default=str(REPO / "docs" / "observability" / "fleet.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    dashboard = json.loads(Path(args.dashboard).read_text())
    sources = [args.control_url, *args.node_url]
    history, deadline, step = [], time.monotonic() + args.seconds, 0
    while not history or time.monotonic() < deadline:
        if args.api_key:
            traffic(args.control_url, args.api_key, step)
        history.append((time.time(), scrape(sources, args.token)))
        step += 1
        time.sleep(args.interval)  # the scrape interval: a pace, not a wait for a condition
    rows = (len(dashboard["panels"]) + 1) // 2
    with tempfile.TemporaryDirectory() as folder:
        rendered = Path(folder) / "dashboard.html"
        rendered.write_text(page(dashboard, history, sources))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        size = f"--window-size={2 * 560 + 32},{rows * 258 + 110}"
        command = [args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", size]
        subprocess.run([*command, f"--screenshot={args.out}", rendered.as_uri()], check=True, timeout=120)
    print(f"{args.out}: {len(dashboard['panels'])} panels from {len(history)} scrapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
