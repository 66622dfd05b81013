"""GET /api/v1/usage with the metered series (JSON and CSV), /invoices and /admin/rates: tenants see only their own,
staff see all; validation errors are 400s with codes."""

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from audit.actions import AuditAction
from audit.models import AuditEvent
from billing import invoices, services
from billing.models import LedgerHour, Rate
from tests.billing.conftest import GB

pytestmark = pytest.mark.django_db
MARCH = datetime(2026, 3, 1, tzinfo=UTC)
GB_HOUR = GB * 3600
SNAPSHOT_FIELDS = {"tenant_id", "limits", "used", "resident", "over_quota", "over_quota_limits"}


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == code, response.content
    return response.json()["error"]


@pytest.fixture
def two_tenants(make_tenant, make_cache, reporting_node):
    """(tenant A handle, its cache, tenant B handle, its cache) with ledger hours on 1 and 2 March."""
    a, b = make_tenant(scopes=("usage:read",)), make_tenant(scopes=("usage:read",))
    cache_a, cache_b = make_cache(a.tenant, reporting_node.node), make_cache(b.tenant, reporting_node.node)
    for hour, seconds in ((0, GB_HOUR * 2), (1, GB_HOUR // 2), (25, GB_HOUR)):
        LedgerHour.objects.create(
            cache=cache_a,
            tenant=a.tenant,
            hour=MARCH + timedelta(hours=hour),
            device_byte_seconds=seconds,
            ssd_byte_seconds=3,
            bytes_written=10,
            tokens_served=hour,
        )
    LedgerHour.objects.create(cache=cache_b, tenant=b.tenant, hour=MARCH, device_byte_seconds=GB_HOUR * 100)
    return a, cache_a, b, cache_b


def _series(client, **query):
    response = client.get("/api/v1/usage", {"from": "2026-03-01T00:00:00Z", "to": "2026-03-03T00:00:00Z", **query})
    assert response.status_code == 200, response.content
    return response.json()


def test_the_series_by_day_has_exact_gb_hours_per_tier(two_tenants):
    a, _, _, _ = two_tenants
    body = _series(a.client, granularity="day")
    assert set(body) == {*SNAPSHOT_FIELDS, "series"}  # the snapshot is still there
    series = body["series"]
    assert (series["granularity"], series["from"], series["to"]) == (
        "day",
        "2026-03-01T00:00:00Z",
        "2026-03-03T00:00:00Z",
    )
    first, second = series["buckets"]
    assert first == {
        "period_start": "2026-03-01T00:00:00+00:00",
        "device_byte_seconds": GB_HOUR * 2 + GB_HOUR // 2,
        "dram_byte_seconds": 0,
        "ssd_byte_seconds": 6,
        "device_gb_hours": "2.5",
        "dram_gb_hours": "0",
        "ssd_gb_hours": "0.000000000001666666666666666667",
        "network_byte_seconds": 0,
        "network_gb_hours": "0",
        "bytes_written": 20,
        "tokens_served": 1,
    }
    assert (second["period_start"], second["device_gb_hours"], second["tokens_served"]) == (
        "2026-03-02T00:00:00+00:00",
        "1",
        25,
    )


def test_by_hour_and_by_month(two_tenants):
    a, _, _, _ = two_tenants
    hours = _series(a.client, granularity="hour")["series"]["buckets"]
    assert [(b["period_start"][11:13], b["device_gb_hours"]) for b in hours] == [
        ("00", "2"),
        ("01", "0.5"),
        ("01", "1"),
    ]
    (month,) = _series(a.client, granularity="month")["series"]["buckets"]
    assert (month["period_start"], month["device_gb_hours"], month["bytes_written"]) == (
        "2026-03-01T00:00:00+00:00",
        "3.5",
        30,
    )


def test_csv_has_the_same_numbers(two_tenants):
    a, _, _, _ = two_tenants
    response = a.client.get(
        "/api/v1/usage",
        {"from": "2026-03-01T00:00:00Z", "to": "2026-03-03T00:00:00Z", "granularity": "day", "format": "csv"},
    )
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["period_start"], r["device_gb_hours"], r["tokens_served"]) for r in rows] == [
        ("2026-03-01T00:00:00+00:00", "2.5", "1"),
        ("2026-03-02T00:00:00+00:00", "1", "25"),
    ]


def test_each_tenant_sees_only_its_own_series(two_tenants, staff_client):
    a, _, b, _ = two_tenants
    (mine,) = _series(b.client, granularity="month")["series"]["buckets"]
    assert mine["device_gb_hours"] == "100"
    _error(
        a.client.get(
            "/api/v1/usage",
            {"tenant_id": str(b.tenant.pk), "from": "2026-03-01T00:00:00Z", "to": "2026-03-02T00:00:00Z"},
        ),
        404,
        "not_found",
    )
    (staff_view,) = _series(staff_client, granularity="month", tenant_id=str(b.tenant.pk))["series"]["buckets"]
    assert staff_view == mine


def test_without_a_period_the_answer_is_the_snapshot_alone(two_tenants):
    a, _, _, _ = two_tenants
    body = a.client.get("/api/v1/usage").json()
    assert set(body) == SNAPSHOT_FIELDS


@pytest.mark.parametrize(
    "query",
    [
        {"from": "2026-03-01T00:00:00Z"},
        {"granularity": "day"},
        {"format": "csv"},
        {"from": "2026-03-02T00:00:00Z", "to": "2026-03-01T00:00:00Z"},
        {"from": "2020-01-01T00:00:00Z", "to": "2026-01-01T00:00:00Z", "granularity": "hour"},
    ],
)
def test_a_bad_period_is_400_invalid_period(two_tenants, query):
    a, _, _, _ = two_tenants
    _error(a.client.get("/api/v1/usage", query), 400, "invalid_period")


@pytest.mark.parametrize(
    "query",
    [
        {"granularity": "week", "from": "2026-03-01T00:00:00Z", "to": "2026-03-02T00:00:00Z"},
        {"from": "monday", "to": "2026-03-02T00:00:00Z"},
        {"format": "xml"},
    ],
)
def test_malformed_parameters_are_400_validation_error(two_tenants, query):
    a, _, _, _ = two_tenants
    _error(a.client.get("/api/v1/usage", query), 400, "validation_error")


# ---- invoices -------------------------------------------------------------------------------------------------------


@pytest.fixture
def march_invoices(two_tenants):
    services.rate_create(meter="device_gb_hour", unit_price=Decimal("0.5"), effective_from=MARCH)
    a, _, b, _ = two_tenants
    now = datetime(2026, 3, 20, tzinfo=UTC)
    return (
        invoices.invoice_generate(tenant_id=a.tenant.pk, month=MARCH, now=now),
        invoices.invoice_generate(tenant_id=b.tenant.pk, month=MARCH, now=now),
    )


def test_a_tenant_lists_and_reads_only_its_own_invoices(two_tenants, march_invoices):
    a, cache_a, b, _ = two_tenants
    mine, theirs = march_invoices
    listed = a.client.get("/api/v1/invoices").json()
    assert listed["count"] == 1 and listed["results"][0]["id"] == str(mine.pk)
    body = a.client.get(f"/api/v1/invoices/{mine.pk}").json()
    assert (body["month"], body["status"], body["total"], body["subtotal"], body["currency"]) == (
        "2026-03",
        "draft",
        "1.75",
        "1.75",
        "USD",
    )
    assert body["lines"] == [
        {
            "cache_id": str(cache_a.pk),
            "meter": "device_gb_hour",
            "usage": GB_HOUR * 7 // 2,
            "quantity": "3.5",
            "unit_price": "0.5",
            "rate_effective_from": "2026-03-01T00:00:00Z",
            "amount": "1.75",
        }
    ]
    _error(a.client.get(f"/api/v1/invoices/{theirs.pk}"), 404, "not_found")
    _error(a.client.get(f"/api/v1/invoices/{uuid.uuid4()}"), 404, "not_found")
    _error(a.client.get("/api/v1/invoices", {"tenant_id": str(b.tenant.pk)}), 404, "not_found")


def test_staff_see_every_invoice_or_one_tenants(two_tenants, march_invoices, staff_client):
    _, _, b, _ = two_tenants
    assert staff_client.get("/api/v1/invoices").json()["count"] == 2
    only_b = staff_client.get("/api/v1/invoices", {"tenant_id": str(b.tenant.pk)}).json()
    assert [row["total"] for row in only_b["results"]] == ["50.00"]
    assert staff_client.get(f"/api/v1/invoices/{march_invoices[0].pk}").status_code == 200


def test_invoices_need_the_usage_scope(make_tenant):
    _error(make_tenant(scopes=("caches:read",)).client.get("/api/v1/invoices"), 403, "permission_denied")


# ---- rates ----------------------------------------------------------------------------------------------------------


def test_staff_create_and_list_rates_audited(staff_client):
    body = {"meter": "ssd_gb_hour", "unit_price": "0.0125", "effective_from": "2026-04-01T00:00:00Z"}
    created = staff_client.post("/api/v1/admin/rates", body, format="json")
    assert created.status_code == 201, created.content
    assert (created.json()["meter"], created.json()["unit_price"]) == ("ssd_gb_hour", "0.0125000000")
    rate = Rate.objects.get()
    assert rate.unit_price == Decimal("0.0125")
    event = AuditEvent.objects.get(action=AuditAction.RATE_CREATED)
    assert (event.target_id, event.new_values["unit_price"]) == (str(rate.pk), "0.0125")
    _error(staff_client.post("/api/v1/admin/rates", body, format="json"), 409, "rate_exists")
    listed = staff_client.get("/api/v1/admin/rates", {"meter": "ssd_gb_hour"}).json()
    assert [row["effective_from"] for row in listed["results"]] == ["2026-04-01T00:00:00Z"]
    assert AuditEvent.objects.filter(action=AuditAction.RATE_CREATED).count() == 1


@pytest.mark.parametrize(
    "body, code",
    [
        ({"meter": "ssd_gb_hour", "unit_price": "1", "effective_from": "2026-04-01T00:30:00Z"}, "invalid_rate"),
        ({"meter": "gpu_hour", "unit_price": "1", "effective_from": "2026-04-01T00:00:00Z"}, "validation_error"),
        ({"meter": "ssd_gb_hour", "unit_price": "-1", "effective_from": "2026-04-01T00:00:00Z"}, "validation_error"),
        ({"meter": "ssd_gb_hour", "unit_price": "NaN", "effective_from": "2026-04-01T00:00:00Z"}, "validation_error"),
    ],
)
def test_bad_rates_are_400(staff_client, body, code):
    _error(staff_client.post("/api/v1/admin/rates", body, format="json"), 400, code)
    assert not Rate.objects.exists()


def test_tenants_cannot_touch_rates(tenant_a):
    body = {"meter": "ssd_gb_hour", "unit_price": "1", "effective_from": "2026-04-01T00:00:00Z"}
    assert tenant_a.client.post("/api/v1/admin/rates", body, format="json").status_code == 403
    assert tenant_a.client.get("/api/v1/admin/rates").status_code == 403
