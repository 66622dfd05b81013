"""The ledger from real reports on PostgreSQL: exact GB-hours, duplicates and reordering bill once, a restart neither
loses nor doubles, late reports inside the grace count, the rollup is reproducible and pruning changes nothing."""

import random
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from billing import ledger, money, services
from billing.models import LedgerHour, UsageSample
from tests.billing.conftest import GB, entry, hours_ago

pytestmark = pytest.mark.django_db
MINUTE = timedelta(minutes=1)


@pytest.fixture
def gap(settings):
    settings.KCAAS_USAGE_MAX_GAP_SECONDS = 300  # reports every 5 minutes in these tests
    return 300


def _rollup(start, hours=4):
    services.ledger_rollup(start=start, end=start + timedelta(hours=hours))


def _ledger(cache) -> dict:
    rows = LedgerHour.objects.filter(cache=cache).order_by("hour")
    return {
        row.hour: (
            row.device_byte_seconds,
            row.dram_byte_seconds,
            row.ssd_byte_seconds,
            row.bytes_written,
            row.tokens_served,
        )
        for row in rows
    }


def _device_gb_hours(cache) -> Decimal:
    return money.gb_hours(sum(row[0] for row in _ledger(cache).values()))


def _two_then_one(start) -> list[tuple]:
    """2 GB for 90 minutes, then 1 GB for 30 minutes, then released: (minute, bytes) every 5 minutes."""
    return [(m, 2 * GB if m < 90 else GB if m < 120 else 0) for m in range(0, 125, 5)]


def test_2_gb_for_90_minutes_then_1_gb_for_30_bills_exactly_3_5_gb_hours(reporting_node, make_tenant, make_cache, gap):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(4)
    for minute, nbytes in _two_then_one(start):
        reporting_node.report(start + minute * MINUTE, [entry(cache, device=nbytes)])
    _rollup(start)
    assert _device_gb_hours(cache) == Decimal("3.5")
    hours = _ledger(cache)
    assert [money.gb_hours(hours[start + timedelta(hours=h)][0]) for h in (0, 1)] == [Decimal(2), Decimal("1.5")]
    assert set(hours) == {start, start + timedelta(hours=1)}  # the 0-byte sample holds nothing


def test_duplicate_and_reordered_reports_bill_once(make_reporting_node, make_tenant, make_cache, gap):
    tenant = make_tenant().tenant
    in_order, shuffled = make_reporting_node(), make_reporting_node()
    a, b = make_cache(tenant, in_order.node), make_cache(tenant, shuffled.node)
    start = hours_ago(4)
    bodies = []
    for index, (minute, nbytes) in enumerate(_two_then_one(start)):
        at = start + minute * MINUTE
        in_order.report(at, [entry(a, device=nbytes, written=100 * index, served=7 * index)])
        bodies.append(shuffled.body(at, [entry(b, device=nbytes, written=100 * index, served=7 * index)]))
    resent = bodies + random.Random(5).sample(bodies, 10)  # every report, then some of them again
    random.Random(7).shuffle(resent)
    answers = [shuffled.post(body).json() for body in resent]
    assert sum(not answer["duplicate"] for answer in answers) == len(bodies)
    _rollup(start)
    assert _ledger(a) == {hour: usage for hour, usage in _ledger(b).items()}
    assert _device_gb_hours(b) == Decimal("3.5")
    assert sum(row[3] for row in _ledger(b).values()) == 100 * (len(bodies) - 1)
    assert sum(row[4] for row in _ledger(b).values()) == 7 * (len(bodies) - 1)


def test_a_node_restart_mid_hour_neither_loses_nor_doubles_usage(reporting_node, make_tenant, make_cache, gap):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(4)
    old_boot, new_boot = str(uuid.uuid4()), str(uuid.uuid4())
    # boot 1: 0..25 min at 1 GB, counters 0 -> 500 bytes written, 0 -> 50 tokens served
    for step, minute in enumerate(range(0, 30, 5)):
        reporting_node.report(
            start + minute * MINUTE, [entry(cache, device=GB, written=100 * step, served=10 * step)], boot_id=old_boot
        )
    # the agent restarts at minute 27; boot 2 reports from minute 28, its counters from 0 again: +30 bytes, +4 tokens
    for step, minute in enumerate([28, 33, 38, 43, 48, 53, 58]):
        sample = entry(cache, device=GB, written=10 * step, served=2 * step // 3)
        reporting_node.report(start + minute * MINUTE, [sample], boot_id=new_boot, sequence=step + 1)
    reporting_node.report(
        start + 60 * MINUTE, [entry(cache, device=0, written=60, served=4)], boot_id=new_boot, sequence=99
    )
    _rollup(start)
    device, _, _, written, served = _ledger(cache)[start]
    assert device == GB * 3600  # one full hour of 1 GB: the old boot's last sample held until the new boot's first
    assert written == 500 + 60 and served == 50 + 4


def test_a_late_report_inside_the_grace_counts_and_after_it_is_ignored(
    reporting_node, make_tenant, make_cache, gap, settings
):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(3)
    for minute in (0, 5, 15, 20):  # the report of minute 10 is still queued on the node
        reporting_node.report(start + minute * MINUTE, [entry(cache, device=GB)], sequence=minute + 1)
    _rollup(start)
    first = _ledger(cache)[start][0]
    assert first == GB * (5 * 60 + 5 * 60 + 5 * 60 + 5 * 60)  # the sample of minute 5 holds max_gap (5 min)
    reporting_node.report(start + 10 * MINUTE, [entry(cache, device=4 * GB)], sequence=11)  # arrives late
    _rollup(start)
    assert _ledger(cache)[start][0] == GB * (5 * 60 + 5 * 60 + 4 * 5 * 60 + 5 * 60 + 5 * 60)
    settings.KCAAS_USAGE_GRACE_SECONDS = 60  # now 3 h late: past the grace
    assert reporting_node.report(start + 25 * MINUTE, [entry(cache, device=9 * GB)], sequence=26)["late"] is True
    _rollup(start)
    assert _ledger(cache)[start][0] == GB * (5 * 60 + 5 * 60 + 4 * 5 * 60 + 5 * 60 + 5 * 60)


def test_a_sample_holds_at_most_the_max_gap(reporting_node, make_tenant, make_cache, gap):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(4)
    reporting_node.report(start, [entry(cache, device=GB)])
    reporting_node.report(start + timedelta(hours=2), [entry(cache, device=GB)])  # the node was silent for 2 h
    _rollup(start)
    assert {hour: row[0] for hour, row in _ledger(cache).items()} == {
        start: GB * 300,
        start + timedelta(hours=2): GB * 300,
    }


def test_the_rollup_is_reproducible_and_pruning_keeps_the_open_hours(
    reporting_node, make_tenant, make_cache, gap, settings
):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(6)
    for step, minute in enumerate(range(0, 6 * 60, 5)):
        reporting_node.report(start + minute * MINUTE, [entry(cache, device=GB + step, written=step * 3)])
    _rollup(start, hours=7)
    once = _ledger(cache)
    _rollup(start, hours=7)
    assert _ledger(cache) == once and len(once) == 6
    settings.KCAAS_USAGE_GRACE_SECONDS = 2 * 3600  # hours before ~now-2h05 are frozen: prune their samples
    kept_before = UsageSample.objects.count()
    assert services.usage_samples_prune() > 0 and UsageSample.objects.count() < kept_before
    services.ledger_rollup_open_hours()
    assert _ledger(cache) == once  # the open hours recomputed from what pruning kept: the same rows


def test_counters_count_their_increase_in_the_hour_of_the_sample(reporting_node, make_tenant, make_cache, gap):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(4)
    reporting_node.report(start + 50 * MINUTE, [entry(cache, written=1000, served=10)])  # first of the boot: from 0
    reporting_node.report(start + 55 * MINUTE, [entry(cache, written=1500, served=30)])
    reporting_node.report(start + 65 * MINUTE, [entry(cache, written=1600, served=31)])
    _rollup(start)
    rows = _ledger(cache)
    assert rows[start][3:] == (1500, 30) and rows[start + timedelta(hours=1)][3:] == (100, 1)


# ---- the arithmetic alone -------------------------------------------------------------------------------------------


def _sample(at, nbytes=0, *, boot="b", seq=None, written=0, served=0):
    return ledger.Sample("n", boot, seq if seq is not None else at, at, nbytes, 0, 0, written, served)


def test_integrate_splits_a_sample_across_hours_and_clips_the_window():
    usage = ledger.integrate([_sample(3000, 10), _sample(4200, 0)], start=3600, end=7200, max_gap=3600)
    assert {h: u.byte_seconds["device"] for h, u in usage.items()} == {3600: 10 * 600}


def test_a_restarted_counter_counts_from_zero_again():
    samples = [_sample(0, written=50, seq=1), _sample(60, written=80, seq=2), _sample(120, written=20, seq=3)]
    usage = ledger.integrate(samples, start=0, end=3600, max_gap=60)
    assert usage[0].bytes_written == 50 + 30 + 20


def test_the_beat_tasks_roll_up_prune_and_invoice(reporting_node, make_tenant, make_cache, gap):
    from billing import tasks
    from billing.models import Invoice

    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(2)
    for minute in range(0, 60, 5):
        reporting_node.report(start + minute * MINUTE, [entry(cache, device=GB)])
    assert tasks.rollup() >= 1  # the celery task's body, run in process
    assert _device_gb_hours(cache) == Decimal(1)
    services.rate_create(meter="device_gb_hour", unit_price=Decimal("0.25"), effective_from=start)
    assert tasks.generate_invoices() >= 1
    invoice = Invoice.objects.get(tenant_id=cache.tenant_id)
    assert (invoice.status, invoice.total) == ("draft", Decimal("0.25"))
