"""GET /metrics: the control plane's Prometheus metrics (core.metrics) plus figures read at scrape time (the control
queue's depth, the age of the last usage report), and the middleware that times every request by route name.

Access (settings.KCAAS_METRICS_TOKEN): when set, a scrape must send `Authorization: Bearer <token>` (401
`metrics_unauthorized` otherwise); when empty, only loopback clients may scrape (403 `metrics_forbidden`), which is
what `make up` needs. Nothing exported names a tenant, a cache, a key or a secret.

Processes: with PROMETHEUS_MULTIPROC_DIR set, the answer aggregates every process writing to that folder (gunicorn's
workers; the Celery worker and beat on the same host); without it, the answering process's own values only.
"""

from __future__ import annotations

import hmac
import logging
import os
import time

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from kombu.exceptions import ChannelError
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from billing.models import UsageReport
from core.errors import error_body
from core.metrics import BUILD_INFO, HTTP_REQUEST_SECONDS, HTTP_REQUESTS

logger = logging.getLogger(__name__)

LOOPBACK = frozenset({"127.0.0.1", "::1"})
UNMATCHED = "unmatched"  # a request no URL pattern matched (or refused before resolving): one label, not its path


class RequestMetricsMiddleware:
    """Counts and times every request by its URL pattern's name (bounded), method and status code."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        route = (match.view_name or match.route) if match is not None else UNMATCHED
        method = request.method if request.method in _METHODS else "OTHER"
        HTTP_REQUEST_SECONDS.labels(route=route, method=method).observe(time.perf_counter() - started)
        HTTP_REQUESTS.labels(route=route, method=method, status=str(response.status_code)).inc()
        return response


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class ScrapeTimeCollector:
    """Figures read when scraped: the control queue's depth (the broker's count) and billing's usage lag."""

    def describe(self):
        """The families without values: registering asks for their names, and must touch no broker or database."""
        yield from (_depth_family(), _broker_up_family(), _lag_family())

    def collect(self):
        depth, broker_up = _depth_family(), _broker_up_family()
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        try:
            depth.add_metric([queue], queue_depth(queue))
            broker_up.add_metric([], 1)
        except Exception as error:  # noqa: BLE001 - a broker outage must not fail the scrape: it is what we report
            logger.warning("metrics: the broker did not answer: %s", error)
            broker_up.add_metric([], 0)
        yield depth
        yield broker_up
        yield from _billing_lag()


def queue_depth(queue: str, app=None) -> int:
    """Messages waiting on `queue`, asked of the broker of `app` (default the control plane's): Redis counts its
    list (every priority), the embedded file broker its queue folder's files."""
    if app is None:
        from core.celery import app

    with app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1, timeout=2)
        try:
            return int(connection.default_channel.queue_declare(queue=queue, passive=True).message_count)
        except ChannelError:  # Redis: a queue with no message has no key
            return 0


def _depth_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("kcaas_celery_queue_depth", "Messages waiting in a Celery queue", labels=["queue"])


def _broker_up_family() -> GaugeMetricFamily:
    return GaugeMetricFamily("kcaas_celery_broker_up", "1 when the broker answered the depth query")


def _lag_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "kcaas_billing_usage_report_age_seconds",
        "Seconds since the last node usage report arrived (what billing meters GB-hours from)",
    )


def _billing_lag():
    lag = _lag_family()
    try:
        last = UsageReport.objects.order_by("-received_at").values_list("received_at", flat=True).first()
    except DatabaseError as error:  # a database outage must not fail the scrape: the other figures still matter
        logger.warning("metrics: the database did not answer: %s", error)
        last = None
    if last is not None:
        lag.add_metric([], max(0.0, (timezone.now() - last).total_seconds()))
    yield lag


_SCRAPE_TIME = ScrapeTimeCollector()
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    REGISTRY.register(_SCRAPE_TIME)


def _registry() -> CollectorRegistry:
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(_SCRAPE_TIME)
    registry.register(BUILD_INFO)
    return registry


def _refusal(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(error_body(code, message), status=status)


def metrics_view(request):
    """The Prometheus text exposition; see the module docstring for who may read it."""
    if request.method not in ("GET", "HEAD"):
        return _refusal(405, "method_not_allowed", "Only GET reads /metrics.")
    token = settings.KCAAS_METRICS_TOKEN
    if token:
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            return _refusal(401, "metrics_unauthorized", "Send Authorization: Bearer <KCAAS_METRICS_TOKEN>.")
    elif request.META.get("REMOTE_ADDR") not in LOOPBACK:
        return _refusal(403, "metrics_forbidden", "Without KCAAS_METRICS_TOKEN only loopback clients may scrape.")
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_LATEST)
