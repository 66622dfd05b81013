"""The node side: gpu_node.agent.usage.UsageReporter through gpu_node.agent.process.ControlPlane against the real
control plane (pytest-django live_server on PostgreSQL) as a registered node: reports land as samples, a control plane
that was unreachable gets the queued reports afterwards, in order, and a report refused for good is dropped."""

from datetime import UTC, datetime, timedelta

import pytest

from billing.models import UsageReport, UsageSample
from gpu_node.agent.process import ControlPlane
from gpu_node.agent.usage import UsageReporter
from tests.billing.conftest import GB, entry
from tests.caches.conftest import free_port

pytestmark = pytest.mark.django_db(transaction=True)


class Clock:
    def __init__(self):
        self.now = datetime.now(UTC) - timedelta(minutes=30)

    def __call__(self) -> datetime:
        self.now += timedelta(minutes=1)
        return self.now


@pytest.fixture
def placed(reporting_node, make_tenant, make_cache):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    return reporting_node, cache


def _reporter(control: ControlPlane, cache, **options) -> UsageReporter:
    written = iter(range(0, 10**6, 100))
    return UsageReporter(
        snapshot=lambda: [entry(cache, device=GB, written=next(written))], send=control.usage, clock=Clock(), **options
    )


def test_reports_land_as_samples_of_one_boot_in_sequence(live_server, placed):
    node, cache = placed
    reporter = _reporter(ControlPlane(live_server.url, node.credential), cache)
    assert [reporter.tick() for _ in range(3)] == [1, 1, 1] and reporter.pending == []
    samples = list(UsageSample.objects.order_by("sequence"))
    assert [(s.sequence, str(s.boot_id), s.cache_id, s.bytes_written_total) for s in samples] == [
        (1, reporter.boot_id, cache.pk, 0),
        (2, reporter.boot_id, cache.pk, 100),
        (3, reporter.boot_id, cache.pk, 200),
    ]
    assert UsageReport.objects.filter(node=node.node).count() == 3


def test_reports_queued_while_the_control_plane_was_unreachable_arrive_later_in_order(live_server, placed):
    node, cache = placed
    reporter = _reporter(ControlPlane(f"http://127.0.0.1:{free_port()}", node.credential, timeout=2), cache)
    assert [reporter.tick() for _ in range(3)] == [0, 0, 0]
    assert [r["sequence"] for r in reporter.pending] == [1, 2, 3] and not UsageSample.objects.exists()

    reporter._send = ControlPlane(live_server.url, node.credential).usage  # the control plane is back
    assert reporter.tick() == 4 and reporter.pending == []
    arrival = list(UsageReport.objects.order_by("id").values_list("sequence", flat=True))
    assert arrival == [1, 2, 3, 4]  # sent oldest first
    times = list(UsageSample.objects.order_by("sequence").values_list("sampled_at", flat=True))
    assert times == sorted(times) and len(times) == 4  # each kept the time it was sampled at, not sent at


def test_a_resent_report_is_stored_once(live_server, placed):
    node, cache = placed
    control = ControlPlane(live_server.url, node.credential)
    reporter = _reporter(control, cache)
    report = reporter.collect()
    assert control.usage(report)["duplicate"] is False
    assert reporter.flush() == 1  # the first answer was "lost": the agent sends the same report again
    assert control.usage(report)["duplicate"] is True
    assert UsageSample.objects.count() == 1


def test_a_report_refused_for_good_is_dropped_and_the_next_goes_through(live_server, placed):
    node, cache = placed
    reporter = _reporter(ControlPlane(live_server.url, node.credential), cache)
    reporter.collect()["sampled_at"] = (datetime.now(UTC) + timedelta(days=2)).isoformat()  # 400: in the future
    assert reporter.tick() == 1 and reporter.pending == []
    assert list(UsageSample.objects.values_list("sequence", flat=True)) == [2]


def test_the_queue_is_bounded_dropping_the_oldest(placed):
    node, cache = placed
    reporter = _reporter(
        ControlPlane(f"http://127.0.0.1:{free_port()}", node.credential, timeout=2), cache, max_queued=2
    )
    for _ in range(4):
        reporter.collect()
    assert [r["sequence"] for r in reporter.pending] == [3, 4]
