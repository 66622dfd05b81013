"""Console pages: tenants — the list, one tenant's detail (quota against usage, keys, caches, usage chart,
invoices, a scheduled erasure's warning), and the operator's actions on it (quota edit, key revoke,
suspend/reactivate). Creating a tenant and issuing its keys: console.pages.tenant_onboarding (routes below).

No business logic here: reads go through the rooms' selectors, every change through the same service the REST API
calls (tenants.services.quota_update / api_key_revoke / tenant_set_status), which validates again, takes the
tenant's lock and writes the audit event (actor: the console user, resolved by the audit middleware). A form that
does not validate changes nothing and answers 400.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.utils import timezone

from billing import selectors as billing_selectors
from caches import selectors as cache_selectors
from caches.models import TIERS, CacheState
from caches.token_cascade import data_tokens_revoke_cascade
from console.access import console_view, error_page, page_context
from console.charts import daily_bars, stacked_bar_chart
from console.forms import BYTE_FIELDS, QUOTA_LABELS, QuotaForm, TenantSearchForm, limit_text
from console.pages import tenant_onboarding
from console.series import charts_context
from kcaas.units import human_bytes
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.models import Tenant

PAGE_SIZE = 25
CHART_DAYS = 30
MAX_ROWS = 100  # keys, caches, invoices shown on the detail page (newest first)
TIER_LABELS = {"device": "Device", "dram": "DRAM", "ssd": "SSD", "network": "Network"}


def _render(request, template: str, status: int = 200, **context):
    return render(request, template, page_context(request, section="tenants", **context), status=status)


def _month_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


# ---- list ------------------------------------------------------------------------------------------------------------


def _list_rows(tenants: list[Tenant]) -> list[dict]:
    """Per tenant of one page: live caches, device bytes reserved, GB-hours this month, active keys, an erasure not
    started yet (5 queries)."""
    ids = [tenant.pk for tenant in tenants]
    now = timezone.now()
    usage = cache_selectors.cache_usage_by_tenant(tenant_ids=ids)
    gb_hours = billing_selectors.gb_hours_by_tenant(
        tenant_ids=ids, start=_month_start(now), end=now + timedelta(hours=1)
    )
    keys = tenant_selectors.active_key_counts(tenant_ids=ids, now=now)
    erasures = tenant_onboarding.erasures_by_tenant(ids)
    return [
        {
            "tenant": tenant,
            "caches": usage[tenant.pk].num_caches,
            "device_bytes": usage[tenant.pk].capacity_bytes["device"],
            "device_text": human_bytes(usage[tenant.pk].capacity_bytes["device"]),
            "gb_hours": gb_hours.get(tenant.pk, 0),
            "keys_active": keys.get(tenant.pk, 0),
            "erasure": erasures.get(tenant.pk),
        }
        for tenant in tenants
    ]


@console_view()
def index(request):
    """Tenants, oldest first, 25 a page; ?q= filters by name or id. A bad ?page= shows page 1 (or the last)."""
    form = TenantSearchForm(request.GET)
    valid = form.is_valid()
    query = form.cleaned_data["q"].strip() if valid else ""
    tenants = tenant_selectors.tenant_search(query=query) if valid else Tenant.objects.none()
    page = Paginator(tenants, PAGE_SIZE).get_page(request.GET.get("page"))
    return _render(
        request,
        "console/tenants/list.html",
        status=200 if valid else 400,
        title="Tenants",
        form=form,
        query=query,
        page=page,
        rows=_list_rows(list(page.object_list)),
        page_query=urlencode({"q": query}) if query else "",
    )


# ---- detail ----------------------------------------------------------------------------------------------------------


def _meter(label: str, used: int, limit: int, text: str) -> dict:
    """One quota bar; `empty` (a limit of 0 with nothing used) is written as text, not drawn as a bar."""
    return {
        "label": label,
        "used": used,
        "limit": limit,
        "max": max(limit, 1),
        "over": used > limit,
        "text": text,
        "empty": limit == 0 and used == 0,
    }


def _usage_meters(tenant: Tenant) -> list[dict]:
    """Quota against usage: per tier the capacity live caches reserve (and what nodes report resident) against the
    limit; caches against max_caches; data tokens outstanding against their limit."""
    usage = cache_selectors.tenant_usage(tenant=tenant)
    limits = usage.limits.capacity_bytes()
    meters = []
    for tier in TIERS:
        reserved, resident, limit = usage.caches.capacity_bytes[tier], usage.resident_bytes[tier], limits[tier]
        text = f"{human_bytes(reserved)} of {human_bytes(limit)} reserved ({human_bytes(resident)} resident)"
        meters.append(_meter(TIER_LABELS[tier], reserved, limit, text) | {"exact": f"{reserved} of {limit} bytes"})
    caches, caches_limit = usage.caches.num_caches, usage.limits.max_caches
    meters.append(_meter("Caches", caches, caches_limit, f"{caches} of {caches_limit}"))
    tokens_limit = usage.limits.max_data_tokens_outstanding
    meters.append(
        _meter(
            "Data tokens",
            usage.data_tokens_outstanding,
            tokens_limit,
            f"{usage.data_tokens_outstanding} of {tokens_limit} outstanding",
        )
    )
    return meters


def _chart_range() -> tuple[datetime, datetime]:
    """[start, end) of the chart: the last CHART_DAYS whole UTC days, today included."""
    today = timezone.now().astimezone(UTC).date()
    first = today - timedelta(days=CHART_DAYS - 1)
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    return start, start + timedelta(days=CHART_DAYS)


def _chart_context(tenant: Tenant) -> dict:
    start, end = _chart_range()
    series = billing_selectors.usage_series(tenant_id=tenant.pk, start=start, end=end, granularity="day")
    points = ((bucket.period_start.astimezone(UTC).date(), bucket.gb_hours) for bucket in series)
    bars = daily_bars(points, first_day=start.date(), days=CHART_DAYS)
    return {
        "chart": stacked_bar_chart(bars, title="GB-hours per tier per day", unit="GB-hours"),
        "chart_bars": bars,
        "chart_start": start.date(),
        "chart_end": (end - timedelta(days=1)).date(),
    }


def _quota_rows(tenant: Tenant) -> list[dict]:
    """Each limit: its label, the effective value (human units for bytes) and whether it is the default."""
    limits = tenant_selectors.quota_limits(tenant=tenant)
    overrides = tenant_selectors.quota_overrides(tenant=tenant)
    rows = []
    for field in tenant_services.QUOTA_BOUNDS:
        value = getattr(limits, field)
        shown = f"{human_bytes(value)} ({value} bytes)" if field in BYTE_FIELDS else str(value)
        rows.append({"field": field, "label": QUOTA_LABELS[field], "value": shown, "default": overrides[field] is None})
    return rows


def _quota_form(tenant: Tenant, data=None) -> QuotaForm:
    initial = QuotaForm.initial_from(tenant_selectors.quota_overrides(tenant=tenant))
    return QuotaForm(data, initial=initial, defaults=settings.KCAAS_QUOTA_DEFAULTS)


def _detail_context(tenant: Tenant, *, quota_form: QuotaForm | None = None) -> dict:
    now = timezone.now()
    keys = list(tenant_selectors.api_key_list(tenant=tenant)[:MAX_ROWS])
    caches = list(
        cache_selectors.cache_list(tenant_id=tenant.pk)
        .exclude(state=CacheState.DETACHED)
        .select_related("node")[:MAX_ROWS]
    )
    invoices = list(billing_selectors.invoices_for_tenant(tenant_id=tenant.pk)[:MAX_ROWS])
    return {
        "title": f"Tenant {tenant.name}",
        "tenant": tenant,
        "meters": _usage_meters(tenant),
        "quota_rows": _quota_rows(tenant),
        "quota_form": quota_form or _quota_form(tenant),
        "keys": [{"key": key, "state": key.state_at(now)} for key in keys],
        "caches": [
            {
                "cache": cache,
                "capacity": {tier: human_bytes(getattr(cache, f"{tier}_capacity_bytes")) for tier in TIERS},
            }
            for cache in caches
        ],
        "invoices": [{"invoice": invoice, "lines": len(invoice.lines.all())} for invoice in invoices],
        "max_rows": MAX_ROWS,
        "erasure": tenant_onboarding.erasure_warning(tenant),
        **_chart_context(tenant),
        **charts_context(tenant_id=tenant.pk, cache_ids=_cache_ids(tenant)),
        "scope": f"tenant {tenant.name}",
        "gb_hours_elsewhere": True,  # the ledger's GB-hours chart has its own section, with the 30-day table
    }


def _cache_ids(tenant: Tenant) -> list:
    """Every cache the tenant ever had (detached ones too: their samples stay in the history)."""
    return list(cache_selectors.cache_list(tenant_id=tenant.pk).values_list("pk", flat=True))


@console_view()
def detail(request, tenant_id):
    """One tenant: facts, quota against usage (live), keys, caches, 30-day usage chart, invoices, quota form."""
    tenant = tenant_selectors.tenant_get(tenant_id=tenant_id)
    return _render(request, "console/tenants/detail.html", **_detail_context(tenant))


@console_view()
def usage(request, tenant_id):
    """The quota-against-usage fragment the detail page polls (htmx); a plain GET goes to the detail page."""
    tenant = tenant_selectors.tenant_get(tenant_id=tenant_id)
    if not request.htmx:
        return redirect("console:tenant", tenant_id=tenant.pk)
    return _render(request, "console/tenants/_usage.html", tenant=tenant, meters=_usage_meters(tenant))


# ---- actions -------------------------------------------------------------------------------------------------------


def _limit_text(field: str, value: int | None) -> str:
    if value is None:
        return f"default ({limit_text(field, settings.KCAAS_QUOTA_DEFAULTS[field])})"
    return limit_text(field, value)


@console_view("tenants.edit", methods=("POST",))
def quota_update(request, tenant_id):
    """Operator: set the limits typed (blank: the default) through tenants.services.quota_update. Fields absent from
    the POST are left as they are. Invalid input: 400 with the form's errors, nothing changed, no event."""
    tenant = tenant_selectors.tenant_get(tenant_id=tenant_id)
    form = _quota_form(tenant, request.POST)
    if not form.is_valid():
        context = _detail_context(tenant, quota_form=form)
        return _render(request, "console/tenants/detail.html", status=400, **context)
    before = tenant_selectors.quota_overrides(tenant=tenant)
    changed = {
        field: form.cleaned_data[field]
        for field in tenant_services.QUOTA_BOUNDS
        if field in request.POST and form.cleaned_data[field] != before[field]
    }
    tenant_services.quota_update(tenant=tenant, **changed)
    if changed:
        what = "; ".join(
            f"{QUOTA_LABELS[field]}: {_limit_text(field, before[field])} -> {_limit_text(field, value)}"
            for field, value in changed.items()
        )
        messages.success(request, f"Quota of {tenant.name} updated: {what}.")
    else:
        messages.info(request, f"Quota of {tenant.name}: nothing changed.")
    return redirect(reverse("console:tenant", kwargs={"tenant_id": tenant.pk}) + "#quota")


@console_view("tenants.edit", methods=("GET", "POST"))
def key_revoke(request, tenant_id, key_id):
    """Operator: GET asks for confirmation, POST revokes through tenants.services.api_key_revoke. The key must be
    this tenant's (another tenant's key id is a 404, as in the REST API)."""
    tenant = tenant_selectors.tenant_get(tenant_id=tenant_id)
    api_key = tenant_selectors.api_key_get(key_id=key_id, tenant=tenant)
    detail_url = reverse("console:tenant", kwargs={"tenant_id": tenant.pk})
    handle = f"kc_live_{api_key.public_id}_…" + (f" ({api_key.name})" if api_key.name else "")
    if request.method == "GET":
        return _render(
            request,
            "console/confirm.html",
            title="Revoke API key",
            question=f"Revoke the key {handle} of tenant {tenant.name}? Requests with it are refused "
            "from then on, and the data tokens it minted are revoked on the nodes: engines reading or writing "
            "caches with them are disconnected now and must get a token with another key. This cannot be undone.",
            details=[f"Scopes: {', '.join(api_key.scopes)}", f"State: {api_key.state}"],
            action_url=request.path,
            button="Revoke key",
            cancel_url=detail_url,
            danger=True,
        )
    already = api_key.revoked_at is not None
    tenant_services.api_key_revoke(api_key=api_key)
    data_tokens_revoke_cascade(tenant_id=tenant.pk)  # the data tokens it minted: refused on the nodes now
    if already:
        messages.info(request, f"The key {handle} was already revoked: nothing changed.")
    else:
        messages.success(request, f"The key {handle} was revoked: active -> revoked.")
    return redirect(detail_url + "#keys")


_STATUS_ACTIONS = {Tenant.Status.SUSPENDED: "Suspend", Tenant.Status.ACTIVE: "Reactivate"}


@console_view("tenants.edit", methods=("GET", "POST"))
def tenant_status(request, tenant_id):
    """Operator: suspend (its keys are refused) or reactivate a tenant through tenants.services.tenant_set_status;
    ?status= / status= names the new status (active or suspended; anything else is a 400)."""
    tenant = tenant_selectors.tenant_get(tenant_id=tenant_id)
    wanted = (request.POST if request.method == "POST" else request.GET).get("status", "")
    if wanted not in _STATUS_ACTIONS:
        return error_page(request, 400, "Refused", "The status must be active or suspended.", "validation_error")
    detail_url = reverse("console:tenant", kwargs={"tenant_id": tenant.pk})
    if request.method == "GET":
        effect = (
            "Its API keys are refused until it is reactivated, and its data tokens and live data-plane "
            "connections end now."
            if wanted == Tenant.Status.SUSPENDED
            else "Its API keys work again."
        )
        verb = _STATUS_ACTIONS[wanted]
        return _render(
            request,
            "console/confirm.html",
            title=f"{verb} tenant",
            question=f"{verb} tenant {tenant.name} ({tenant.status} -> {wanted})? {effect}",
            action_url=request.path,
            button=f"{verb} tenant",
            cancel_url=detail_url,
            danger=wanted == Tenant.Status.SUSPENDED,
            extra_fields=[("status", wanted)],
        )
    old = tenant.status
    updated = tenant_services.tenant_set_status(tenant=tenant, status=wanted)
    data_tokens_revoke_cascade(tenant_id=tenant.pk)  # a suspended tenant's data tokens and sessions end now
    if updated.status == old:
        messages.info(request, f"Tenant {tenant.name} is already {old}: nothing changed.")
    else:
        messages.success(request, f"Tenant {tenant.name}: {old} -> {updated.status}.")
    return redirect(detail_url)


urlpatterns = [
    path("", index, name="tenants"),
    path("new", tenant_onboarding.tenant_new, name="tenant_new"),
    path("<uuid:tenant_id>/", detail, name="tenant"),
    path("<uuid:tenant_id>/usage", usage, name="tenant_usage"),
    path("<uuid:tenant_id>/quota", quota_update, name="quota_update"),
    path("<uuid:tenant_id>/status", tenant_status, name="tenant_status"),
    path("<uuid:tenant_id>/keys/new", tenant_onboarding.key_issue, name="key_issue"),
    path("<uuid:tenant_id>/keys/<uuid:key_id>/revoke", key_revoke, name="key_revoke"),
]
