"""The control plane's Prometheus metrics: defined here (the ground floor), bumped by the rooms, exported by
controlplane.metrics at /metrics (docs/observability.md lists them).

Multi-process: when PROMETHEUS_MULTIPROC_DIR is set (before this module is imported), prometheus_client keeps every
value in a per-process file there and /metrics aggregates the files of every process sharing the folder (gunicorn's
workers, and the Celery worker and beat when they run on the same host with the same folder). Without it, each
process has its own values in the default registry and /metrics shows only the answering process's.

Labels are bounded: a route's name (never the raw path), a status code, a Celery task's name, an application error
code; never a tenant, cache or key id.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

disable_created_metrics()  # no `_created` series: they double the series count and no dashboard reads them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
MAX_CODE_LENGTH = 64  # an outcome label longer than this is not one of our error codes: counted as "error"

HTTP_REQUESTS = Counter(
    "kcaas_http_requests", "HTTP requests answered, by route name, method and status", ["route", "method", "status"]
)


class LatencyHistogram:
    """A latency observed into `name` (`*_duration_seconds`, Prometheus' convention) and into `deprecated`, its
    old name, kept for one release so that dashboards that read it keep working (its HELP says it is deprecated)."""

    def __init__(self, name: str, deprecated: str, documentation: str, labelnames=(), **options):
        self.current = Histogram(name, documentation, labelnames, **options)
        self.deprecated = Histogram(deprecated, f"Deprecated, use {name}: {documentation}", labelnames, **options)

    def labels(self, **labels) -> _Both:
        """The labelled children of both histograms, observed together."""
        return _Both(self.current.labels(**labels), self.deprecated.labels(**labels))

    def observe(self, seconds: float) -> None:
        """One observation into both (an unlabelled histogram)."""
        _Both(self.current, self.deprecated).observe(seconds)


class _Both:
    def __init__(self, *children):
        self._children = children

    def observe(self, seconds: float) -> None:
        for child in self._children:
            child.observe(seconds)


class BuildInfoCollector:
    """`kcaas_build_info{version=...} 1`: which build this process runs. Read at scrape time (no per-process file)."""

    def collect(self):
        info = GaugeMetricFamily("kcaas_build_info", "Always 1; the version of the running build", labels=["version"])
        info.add_metric([build_version()], 1)
        yield info


def build_version() -> str:
    """The installed kcaas distribution's version, or `unknown` outside an install."""
    try:
        return importlib.metadata.version("kcaas")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BUILD_INFO = BuildInfoCollector()
REGISTRY.register(BUILD_INFO)  # a multi-process exporter registers it on its own registry too

HTTP_REQUEST_SECONDS = LatencyHistogram(
    "kcaas_http_request_duration_seconds",
    "kcaas_http_request_seconds",
    "HTTP request latency by route name",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
)
CACHE_ATTACHES = Counter("kcaas_cache_attaches", "Cache attaches by outcome (ok or the error code)", ["outcome"])
PLACEMENT_FAILURES = Counter("kcaas_placement_failures", "Placements refused, by reason", ["reason"])
NODE_LEASE_EXPIRIES = Counter("kcaas_node_lease_expiries", "Nodes marked lost because their lease expired")
AUDIT_WRITE_SECONDS = LatencyHistogram(
    "kcaas_audit_write_duration_seconds",
    "kcaas_audit_write_seconds",
    "Latency of one audit event write (head lock, hash, insert)",
    buckets=LATENCY_BUCKETS,
)
AUDIT_WRITE_FAILURES = Counter("kcaas_audit_write_failures", "Audit writes that failed (answered audit_unavailable)")
CELERY_TASKS = Counter("kcaas_celery_tasks", "Celery task outcomes by task name", ["task", "outcome"])
BILLING_LAST_ROLLUP = Gauge(
    "kcaas_billing_last_rollup_timestamp_seconds",
    "Unix time of the last completed billing rollup (ledger hours recomputed)",
    multiprocess_mode="max",
)


def outcome_label(error: BaseException | None) -> str:
    """`ok`, or the application error code of `error` (bounded: codes are class attributes), else `error`."""
    if error is None:
        return "ok"
    code = getattr(error, "code", None)
    return code if isinstance(code, str) and 0 < len(code) <= MAX_CODE_LENGTH else "error"


@contextmanager
def counted_outcome(counter: Counter) -> Iterator[None]:
    """Counts the block's outcome in `counter`'s `outcome` label; the exception, if any, propagates."""
    try:
        yield
    except Exception as error:
        counter.labels(outcome=outcome_label(error)).inc()
        raise
    counter.labels(outcome="ok").inc()


@contextmanager
def timed_audit_write() -> Iterator[None]:
    """Observes one audit write's latency; a failed write is counted too."""
    started = time.perf_counter()
    try:
        yield
    except Exception:
        AUDIT_WRITE_FAILURES.inc()
        raise
    finally:
        AUDIT_WRITE_SECONDS.observe(time.perf_counter() - started)


def connect_celery_signals() -> None:
    """Count task outcomes (success, failure, retry) by task name, in the process running the tasks."""
    from celery import signals

    signals.task_success.connect(_on_success, weak=False)
    signals.task_failure.connect(_on_failure, weak=False)
    signals.task_retry.connect(_on_retry, weak=False)
    signals.worker_init.connect(serve_worker_metrics, weak=False)


def serve_worker_metrics(**_):
    """With KCAAS_WORKER_METRICS_PORT set, a Celery worker serves its own /metrics (prometheus_client's server, a
    daemon thread, on KCAAS_WORKER_METRICS_ADDR, default 127.0.0.1): for a worker that shares no
    PROMETHEUS_MULTIPROC_DIR with the web server (its own container). Returns the server, or None."""
    port = os.environ.get("KCAAS_WORKER_METRICS_PORT")
    if not port:
        return None
    registry = REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(BUILD_INFO)
    addr = os.environ.get("KCAAS_WORKER_METRICS_ADDR") or "127.0.0.1"
    server, _thread = start_http_server(int(port), addr=addr, registry=registry)
    return server


def _task_name(task) -> str:
    return str(getattr(task, "name", None) or "unknown")


def _on_success(sender=None, **_) -> None:
    CELERY_TASKS.labels(task=_task_name(sender), outcome="success").inc()


def _on_failure(sender=None, **_) -> None:
    CELERY_TASKS.labels(task=_task_name(sender), outcome="failure").inc()


def _on_retry(sender=None, request=None, **_) -> None:
    name = getattr(request, "task", None) or _task_name(sender)
    CELERY_TASKS.labels(task=str(name), outcome="retry").inc()
