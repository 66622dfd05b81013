"""The network tier in billing: nodes report each cache's objects in the fleet's network store as `network_bytes`
(an older agent's report without it stays valid and means 0); the ledger integrates them into network
byte-seconds, the usage API shows them, and invoices bill them on the `network_gb_hour` meter."""

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from billing import invoices, services
from billing.models import METERS, LedgerHour, UsageSample
from tests.billing.conftest import GB, entry, hours_ago

pytestmark = pytest.mark.django_db
GB_HOUR = GB * 3600


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == code, response.content
    return response.json()["error"]


def test_network_bytes_are_stored_and_an_older_report_without_them_means_zero(reporting_node, make_tenant, make_cache):
    tenant = make_tenant().tenant
    new, old = make_cache(tenant, reporting_node.node), make_cache(tenant, reporting_node.node)
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    answer = reporting_node.report(at, [entry(new, device=GB) | {"network_bytes": 3 * GB}, entry(old, device=GB)])
    assert answer["accepted"] == 2 and answer["refused"] == []
    stored = dict(UsageSample.objects.values_list("cache_id", "network_bytes"))
    assert stored == {new.pk: 3 * GB, old.pk: 0}


@pytest.mark.parametrize("bad", [-1, "3GB", True, 2.5, None])
def test_a_bad_network_figure_is_400_naming_it(reporting_node, make_tenant, make_cache, bad):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    body = reporting_node.body(datetime.now(UTC), [entry(cache) | {"network_bytes": bad}])
    error = _error(reporting_node.post(body), 400, "validation_error")
    assert "network_bytes" in str(error["details"])
    assert not UsageSample.objects.exists()


def test_the_ledger_integrates_network_bytes_into_their_own_meter(reporting_node, make_tenant, make_cache, settings):
    settings.KCAAS_USAGE_MAX_GAP_SECONDS = 1800  # each sample holds until the next, 30 min later
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    start = hours_ago(3)
    for minutes in range(0, 61, 30):  # one hour of samples, 30 min apart, 2 GB in the store throughout
        sample = entry(cache, device=GB) | {"network_bytes": 2 * GB}
        reporting_node.report(start + timedelta(minutes=minutes), [sample], sequence=minutes + 1)
    services.ledger_rollup(start=start, end=start + timedelta(hours=1))
    (hour,) = LedgerHour.objects.filter(cache=cache, hour=start)
    assert (hour.network_byte_seconds, hour.device_byte_seconds) == (2 * GB * 3600, GB * 3600)


def test_the_usage_api_shows_network_limits_use_and_gb_hours(reporting_node, make_tenant, make_cache):
    handle = make_tenant(scopes=("usage:read",), max_network_bytes=7 * GB)
    cache = make_cache(handle.tenant, reporting_node.node)
    start = hours_ago(3)
    LedgerHour.objects.create(
        cache=cache, tenant=handle.tenant, hour=start, network_byte_seconds=GB_HOUR // 2, device_byte_seconds=0
    )
    period = {"from": start.isoformat(), "to": (start + timedelta(hours=1)).isoformat(), "granularity": "hour"}
    body = handle.client.get("/api/v1/usage", period).json()
    assert body["limits"]["max_network_bytes"] == 7 * GB
    assert body["used"]["network_bytes"] == 0 and body["resident"]["network_bytes"] == 0
    (bucket,) = body["series"]["buckets"]
    assert (bucket["network_byte_seconds"], bucket["network_gb_hours"]) == (GB_HOUR // 2, "0.5")


def test_invoices_bill_network_gb_hours(reporting_node, make_tenant, make_cache):
    assert "network_gb_hour" in METERS
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    services.rate_create(
        meter="network_gb_hour", unit_price=Decimal("0.02"), effective_from=datetime(2026, 1, 1, tzinfo=UTC)
    )
    march = datetime(2026, 3, 1, tzinfo=UTC)
    LedgerHour.objects.create(cache=cache, tenant_id=cache.tenant_id, hour=march, network_byte_seconds=5 * GB_HOUR)
    invoice = invoices.invoice_generate(
        tenant_id=cache.tenant_id, month=date(2026, 3, 1), now=march + timedelta(days=2)
    )
    lines = {(line.meter, line.quantity, line.amount) for line in invoice.lines.all()}
    assert lines == {("network_gb_hour", Decimal(5), Decimal("0.1"))}
