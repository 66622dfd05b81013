"""billing.selectors.gb_hours_by_tenant: GB-hours of all tiers per tenant in [start, end) (the console's list)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing import money, selectors
from billing.models import LedgerHour
from tests.billing.conftest import GB

pytestmark = pytest.mark.django_db
MARCH = datetime(2026, 3, 1, tzinfo=UTC)
GB_HOUR = GB * 3600


def test_sums_every_tier_within_the_window_per_tenant(make_tenant, make_cache, reporting_node):
    a, b, idle = make_tenant(), make_tenant(), make_tenant()
    cache_a, cache_b = make_cache(a.tenant, reporting_node.node), make_cache(b.tenant, reporting_node.node)
    LedgerHour.objects.create(
        cache=cache_a,
        tenant=a.tenant,
        hour=MARCH,
        device_byte_seconds=2 * GB_HOUR,
        dram_byte_seconds=GB_HOUR // 2,
        ssd_byte_seconds=GB_HOUR // 4,
    )
    # 31 March 23:00 is inside; 1 April 00:00 (the end is excluded) and 28 February 23:00 are not
    for hour in (MARCH + timedelta(days=31, hours=-1), MARCH + timedelta(days=31), MARCH - timedelta(hours=1)):
        LedgerHour.objects.create(cache=cache_a, tenant=a.tenant, hour=hour, device_byte_seconds=GB_HOUR)
    LedgerHour.objects.create(cache=cache_b, tenant=b.tenant, hour=MARCH + timedelta(hours=5), ssd_byte_seconds=3)
    april = datetime(2026, 4, 1, tzinfo=UTC)
    totals = selectors.gb_hours_by_tenant(tenant_ids=[a.tenant.pk, b.tenant.pk, idle.tenant.pk], start=MARCH, end=april)
    assert totals == {a.tenant.pk: Decimal("3.75"), b.tenant.pk: money.gb_hours(3)}
    assert selectors.gb_hours_by_tenant(tenant_ids=[b.tenant.pk], start=MARCH, end=april) == {
        b.tenant.pk: totals[b.tenant.pk]
    }
