"""Console pages: the overview — fleet capacity and use per tier, nodes and caches by state, the hit rate (the live
part, polled every 5 s) and the top tenants by GB-hours this UTC month.

Every number comes from a room's selectors; this module only arranges them for the templates.
"""

from __future__ import annotations

import uuid

from django.shortcuts import render
from django.urls import NoReverseMatch, path, reverse
from django.utils import timezone

from billing.invoices import month_start
from billing.selectors import top_tenants_by_gb_hours
from caches.network_store import network_tier_use
from caches.selectors import cache_state_counts
from console.access import console_view, page_context
from console.series import charts_context
from fleet.selectors import fleet_hit_totals, fleet_tier_use, node_state_counts

TOP_TENANTS = 10


def tenant_url(tenant_id: uuid.UUID) -> str:
    """The console page of a tenant ("console:tenant"; its literal path while that page is not routed)."""
    try:
        return reverse("console:tenant", args=[tenant_id])
    except NoReverseMatch:
        return f"/console/tenants/{tenant_id}/"


def live_context() -> dict:
    """What the polled part shows: tiers, node and cache counts by state (every state, zeros included), hit rate."""
    hits = fleet_hit_totals()
    return {
        "tiers": [*fleet_tier_use(), network_tier_use()],  # the fleet's network store after the node tiers
        "node_states": node_state_counts(),
        "cache_states": cache_state_counts(),
        "hits": hits,
        "hit_rate_percent": None if hits.rate is None else hits.rate * 100,
    }


def top_tenants_context(now) -> dict:
    since = month_start(now)
    top = top_tenants_by_gb_hours(since=since, limit=TOP_TENANTS)
    return {"month_start": since, "top_tenants": [{"usage": row, "url": tenant_url(row.tenant_id)} for row in top]}


def _page(request):
    context = page_context(
        request,
        title="Overview",
        section="overview",
        scope="the fleet",
        **live_context(),
        **top_tenants_context(timezone.now()),
        **charts_context(),
    )
    return render(request, "console/overview.html", context)


@console_view()
def overview(request):
    return _page(request)


@console_view()
def overview_live(request):
    """The live fragment for an htmx poll; the whole page for a plain request."""
    if not request.htmx:
        return _page(request)
    return render(request, "console/overview/_live.html", page_context(request, **live_context()))


urlpatterns = [
    path("", overview, name="overview"),
    path("overview/live", overview_live, name="overview_live"),
]
