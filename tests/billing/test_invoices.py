"""Invoices from the ledger and effective-dated rates: one per tenant and month however often generated, lines
per cache and meter unrounded, the total rounded once (half to even), draft until the grace days pass, then final
(audited) and frozen; the rates API (staff only, audited) and the invoices API (tenants see their own)."""

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from audit.actions import AuditAction
from audit.models import AuditEvent
from billing import invoices, services
from billing.models import Invoice, LedgerHour
from tests.billing.conftest import GB

pytestmark = pytest.mark.django_db
MARCH = datetime(2026, 3, 1, tzinfo=UTC)
DURING_MARCH = datetime(2026, 3, 20, tzinfo=UTC)
GB_HOUR = GB * 3600  # byte-seconds


def _rate(meter, price, effective_from=datetime(2026, 1, 1, tzinfo=UTC)):
    return services.rate_create(meter=meter, unit_price=Decimal(price), effective_from=effective_from)


def _ledger(cache, hour, **usage):
    return LedgerHour.objects.create(cache=cache, tenant_id=cache.tenant_id, hour=hour, **usage)


@pytest.fixture
def cache(reporting_node, make_tenant, make_cache):
    return make_cache(make_tenant().tenant, reporting_node.node)


def test_lines_per_cache_and_meter_and_an_exact_total(cache, make_cache, reporting_node):
    other = make_cache(cache.tenant, reporting_node.node)
    _rate("device_gb_hour", "0.12")
    _rate("write_gb", "0.5")
    _rate("read_million_tokens", "2")
    _ledger(cache, MARCH, device_byte_seconds=2 * GB_HOUR, bytes_written=3 * GB, tokens_served=250_000)
    _ledger(cache, MARCH + timedelta(hours=1), device_byte_seconds=GB_HOUR + GB_HOUR // 2)
    _ledger(other, MARCH + timedelta(days=3), device_byte_seconds=GB_HOUR)
    invoice = invoices.invoice_generate(tenant_id=cache.tenant_id, month=date(2026, 3, 1), now=DURING_MARCH)
    lines = {(line.cache_id, line.meter): (line.quantity, line.amount) for line in invoice.lines.all()}
    assert lines == {
        (cache.pk, "device_gb_hour"): (Decimal("3.5"), Decimal("0.42")),
        (cache.pk, "write_gb"): (Decimal(3), Decimal("1.5")),
        (cache.pk, "read_million_tokens"): (Decimal("0.25"), Decimal("0.5")),
        (other.pk, "device_gb_hour"): (Decimal(1), Decimal("0.12")),
    }
    assert (invoice.subtotal, invoice.total, invoice.status) == (Decimal("2.54"), Decimal("2.54"), "draft")


def test_the_total_is_rounded_once_half_to_even_not_per_line(cache, make_cache, reporting_node):
    _rate("device_gb_hour", "0.004")
    caches = [cache, make_cache(cache.tenant, reporting_node.node), make_cache(cache.tenant, reporting_node.node)]
    for each in caches:
        _ledger(each, MARCH, device_byte_seconds=GB_HOUR)  # 0.004 each: 0.00 per line, 0.012 in all
    invoice = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
    assert [line.amount for line in invoice.lines.all()] == [Decimal("0.004")] * 3
    assert (invoice.subtotal, invoice.total) == (Decimal("0.012"), Decimal("0.01"))
    _ledger(cache, MARCH + timedelta(hours=1), device_byte_seconds=GB_HOUR * 13 // 4)  # +0.013: 0.025 in all
    again = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
    assert (again.subtotal, again.total) == (Decimal("0.025"), Decimal("0.02"))  # half to even, not up


def test_a_rate_change_mid_month_splits_the_meter_at_the_hour(cache):
    _rate("device_gb_hour", "0.10")
    _rate("device_gb_hour", "0.30", effective_from=datetime(2026, 3, 16, tzinfo=UTC))
    _rate("device_gb_hour", "9", effective_from=datetime(2026, 4, 1, tzinfo=UTC))  # next month: not used
    for day in (1, 15, 16, 31):
        _ledger(cache, datetime(2026, 3, day, 23, tzinfo=UTC), device_byte_seconds=GB_HOUR)
    _ledger(cache, datetime(2026, 4, 1, tzinfo=UTC), device_byte_seconds=GB_HOUR)  # April: another invoice
    invoice = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
    lines = [
        (line.unit_price, line.quantity, line.amount, line.rate_effective_from.day) for line in invoice.lines.all()
    ]
    assert lines == [(Decimal("0.1"), Decimal(2), Decimal("0.2"), 1), (Decimal("0.3"), Decimal(2), Decimal("0.6"), 16)]
    assert invoice.total == Decimal("0.80")


def test_usage_before_any_rate_of_its_meter_is_not_billed(cache):
    _rate("dram_gb_hour", "1", effective_from=datetime(2026, 3, 2, tzinfo=UTC))
    _ledger(cache, MARCH, dram_byte_seconds=GB_HOUR, device_byte_seconds=GB_HOUR)  # no device rate at all
    _ledger(cache, datetime(2026, 3, 2, tzinfo=UTC), dram_byte_seconds=GB_HOUR)
    invoice = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
    assert [(line.meter, line.quantity) for line in invoice.lines.all()] == [("dram_gb_hour", Decimal(1))]


def test_generating_twice_makes_one_invoice_and_a_final_one_never_changes(cache, settings):
    settings.KCAAS_INVOICE_GRACE_DAYS = 3
    _rate("device_gb_hour", "1")
    _ledger(cache, MARCH, device_byte_seconds=GB_HOUR)
    first = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
    second = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
    assert first.pk == second.pk and Invoice.objects.count() == 1 and second.status == "draft"
    assert not AuditEvent.objects.filter(action=AuditAction.INVOICE_FINALISED).exists()

    not_yet = datetime(2026, 4, 3, 23, 59, tzinfo=UTC)  # April 1 + 3 days is the first moment it is final
    assert invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=not_yet).status == "draft"
    final = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=datetime(2026, 4, 4, tzinfo=UTC))
    assert (final.pk, final.status, final.total) == (first.pk, "final", Decimal("1.00"))
    event = AuditEvent.objects.get(action=AuditAction.INVOICE_FINALISED)
    assert (event.target_id, event.tenant_id, event.new_values["total"]) == (str(final.pk), cache.tenant_id, "1.00")

    _ledger(cache, MARCH + timedelta(hours=5), device_byte_seconds=GB_HOUR)  # cannot happen after the grace; still:
    again = invoices.invoice_generate(tenant_id=cache.tenant_id, month=MARCH, now=datetime(2026, 5, 1, tzinfo=UTC))
    assert (again.total, again.lines.count(), again.finalised_at) == (Decimal("1.00"), 1, final.finalised_at)
    assert AuditEvent.objects.filter(action=AuditAction.INVOICE_FINALISED).count() == 1


def test_the_beat_generates_every_tenant_with_usage_and_refreshes_drafts(
    cache, reporting_node, make_tenant, make_cache
):
    other = make_cache(make_tenant().tenant, reporting_node.node)
    _rate("device_gb_hour", "1")
    _ledger(cache, MARCH, device_byte_seconds=GB_HOUR)
    _ledger(other, datetime(2026, 2, 27, tzinfo=UTC), device_byte_seconds=GB_HOUR)  # February: previous month
    assert invoices.invoices_generate_due(now=DURING_MARCH) == 2
    assert invoices.invoices_generate_due(now=DURING_MARCH) == 2  # again: the same two drafts, refreshed
    assert sorted((i.tenant_id == cache.tenant_id, i.month.month) for i in Invoice.objects.all()) == [
        (False, 2),
        (True, 3),
    ]


def test_concurrent_generation_makes_one_invoice(transactional_db, cache):
    from tests.caches.conftest import run_in_thread

    _rate("device_gb_hour", "1")
    _ledger(cache, MARCH, device_byte_seconds=GB_HOUR)
    threads = [
        run_in_thread(invoices.invoice_generate, tenant_id=cache.tenant_id, month=MARCH, now=DURING_MARCH)
        for _ in range(4)
    ]
    for thread in threads:
        thread.join(30)
        assert thread.error is None, thread.error
    assert Invoice.objects.count() == 1 and len({thread.result.pk for thread in threads}) == 1
