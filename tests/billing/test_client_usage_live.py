"""kcaas.Client.usage(from_=, to=, granularity=) against the live control plane: the metered series of the caller's
tenant, exact decimal GB-hours as text; without a period the answer is the snapshot alone (series None)."""

from datetime import UTC, datetime, timedelta

import pytest

import kcaas
from billing.models import LedgerHour
from tests.billing.conftest import GB

pytestmark = pytest.mark.django_db(transaction=True)
MARCH = datetime(2026, 3, 1, tzinfo=UTC)


def test_the_client_reads_the_series_of_its_own_tenant(live_server, make_tenant, make_cache, reporting_node):
    mine, other = make_tenant(scopes=("usage:read",)), make_tenant(scopes=("usage:read",))
    cache, theirs = make_cache(mine.tenant, reporting_node.node), make_cache(other.tenant, reporting_node.node)
    LedgerHour.objects.create(
        cache=cache, tenant=mine.tenant, hour=MARCH, device_byte_seconds=7 * GB * 1800, tokens_served=42
    )
    LedgerHour.objects.create(cache=theirs, tenant=other.tenant, hour=MARCH, device_byte_seconds=GB)
    with kcaas.Client(live_server.url, mine.raw_key) as client:
        assert client.usage().series is None
        usage = client.usage(from_=MARCH, to=MARCH + timedelta(days=31), granularity="month")
    (bucket,) = usage.series["buckets"]
    assert (usage.tenant_id, usage.series["granularity"]) == (str(mine.tenant.pk), "month")
    assert (bucket["device_gb_hours"], bucket["tokens_served"]) == ("3.5", 42)
