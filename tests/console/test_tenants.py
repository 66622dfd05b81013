"""Console tenants pages: the list (numbers, search, paging, empty state), the detail (quota against usage, keys,
caches, chart, invoices, never a secret), the quota form (changes through tenants.services.quota_update, bad input
-> 400 and nothing changed, audited as the console user, enforced by the API afterwards), key revoke and
suspend/reactivate (operator only, confirmed, audited, the key refused by the API afterwards), and the role matrix."""

from __future__ import annotations

import itertools
import re
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from audit.actions import AuditAction
from audit.models import AuditEvent
from billing.models import Invoice, InvoiceLine, LedgerHour
from caches import services as cache_services
from caches.models import Cache
from console import roles
from fleet import services as fleet_services
from fleet.models import Node
from kcaas.spec import KVCacheSpec
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.models import ApiKey, Quota, Tenant
from tests.caches.conftest import SPEC
from tests.console.conftest import csrf_token

pytestmark = pytest.mark.django_db
GIB = 2**30
GB_HOUR = 3600 * 10**9  # byte-seconds
CACHE_DEVICE_BYTES = 64 * 2048  # 128 KiB: a whole number of the tiny layout's blocks
_names = itertools.count(1)
_ports = itertools.count(9801)


# ---- helpers -------------------------------------------------------------------------------------------------------


def make_tenant(name: str | None = None, **quota) -> Tenant:
    tenant = tenant_services.tenant_create(name=name or f"console-tenant-{next(_names)}")
    if quota:
        tenant_services.quota_update(tenant=tenant, **quota)
    return tenant


def issue_key(tenant: Tenant, *scopes: str, name: str = "") -> tenant_services.IssuedKey:
    return tenant_services.api_key_issue(tenant=tenant, scopes=list(scopes or ("caches:write",)), name=name)


def bearer(raw_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return client


def make_node() -> Node:
    issued = fleet_services.node_create(name=f"console-node-{uuid.uuid4().hex[:8]}")
    fleet_services.node_register(
        node_id=issued.node.pk,
        endpoint=f"10.3.0.1:{next(_ports)}",
        capacity={"device": 8 * GIB, "dram": 8 * GIB, "ssd": 8 * GIB},
    )
    return Node.objects.get(pk=issued.node.pk)


def attach(tenant: Tenant, name: str) -> Cache:
    """A cache attached through caches.services (placed on a registered node; provisioning is sent on commit,
    which a test transaction never reaches)."""
    return cache_services.cache_attach(
        tenant_id=tenant.pk,
        name=name,
        spec=KVCacheSpec(**SPEC),
        capacity={"device": CACHE_DEVICE_BYTES, "dram": 0, "ssd": 0},
    )


def events(action: AuditAction, **filters) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=int(action), **filters).order_by("seq"))


def quota_row(tenant: Tenant) -> dict:
    quota = Quota.objects.get(tenant=tenant)
    return {field: getattr(quota, field) for field in tenant_services.QUOTA_BOUNDS}


def text(response) -> str:
    return response.content.decode()


def tenant_links(page: str) -> list[str]:
    return re.findall(r'href="/console/tenants/([0-9a-f-]{36})/"', page)


def followed_messages(client: Client, response) -> str:
    assert response.status_code == 302, response.content[:500]
    return text(client.get(response["Location"]))


BLANK_QUOTA = dict.fromkeys(tenant_services.QUOTA_BOUNDS, "")


# ---- list ----------------------------------------------------------------------------------------------------------


def test_list_shows_each_tenants_numbers(readonly_client):
    acme, other = make_tenant("acme-corp"), make_tenant("globex")
    make_node()
    attach(acme, "one"), attach(acme, "two")
    issue_key(acme), issue_key(acme)
    tenant_services.api_key_revoke(api_key=issue_key(acme).api_key)
    hour = timezone.now().astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    cache = Cache.objects.filter(tenant=acme).first()
    LedgerHour.objects.create(
        cache=cache, tenant=acme, hour=hour, device_byte_seconds=3 * GB_HOUR, dram_byte_seconds=GB_HOUR // 2
    )
    LedgerHour.objects.create(cache=cache, tenant=acme, hour=hour - timedelta(days=40), device_byte_seconds=GB_HOUR)
    page = readonly_client.get("/console/tenants/")
    assert page.status_code == 200 and page["Cache-Control"] == "no-store"
    rows = re.findall(r"<tr>\s*<td><a href=\"/console/tenants/[^\"]+/\">([^<]+)</a></td>(.*?)</tr>", text(page), re.S)
    cells = {name: re.findall(r"<td[^>]*>(?:<span[^>]*>)?([^<]*)", rest) for name, rest in rows}
    assert cells["acme-corp"] == ["active", "2", "256 KiB", "3.500", "2"]  # last month's hour is not this month's
    assert cells["globex"] == ["active", "0", "0 B", "0.000", "0"]
    assert tenant_links(text(page)) == [str(acme.pk), str(other.pk)]  # oldest first


def test_search_by_name_part_or_id_and_the_empty_state(readonly_client):
    acme, globex = make_tenant("Acme Corp"), make_tenant("Globex")
    assert tenant_links(text(readonly_client.get("/console/tenants/", {"q": "acme"}))) == [str(acme.pk)]
    assert tenant_links(text(readonly_client.get("/console/tenants/", {"q": str(globex.pk)}))) == [str(globex.pk)]
    page = readonly_client.get("/console/tenants/", {"q": "initech"})
    assert page.status_code == 200 and tenant_links(text(page)) == []
    assert 'class="empty">No tenants match “initech”' in text(page)


@pytest.mark.parametrize("query", ["nul\x00byte", "x" * 101])
def test_bad_search_is_a_400_not_a_500(readonly_client, query):
    make_tenant("acme")
    page = readonly_client.get("/console/tenants/", {"q": query})
    assert page.status_code == 400 and tenant_links(text(page)) == []
    assert 'class="field-error"' in text(page)


def test_paging_25_a_page_and_bad_page_numbers(readonly_client):
    made = [make_tenant(f"t-{index:02d}") for index in range(30)]
    first = readonly_client.get("/console/tenants/")
    assert tenant_links(text(first)) == [str(t.pk) for t in made[:25]]
    assert "Page 1 of 2 (30 in all)" in text(first) and 'href="?page=2"' in text(first)
    second = readonly_client.get("/console/tenants/", {"page": "2"})
    assert tenant_links(text(second)) == [str(t.pk) for t in made[25:]]
    for bad, expected in (("abc", made[:25]), ("0", made[25:]), ("999", made[25:]), ("-1", made[25:])):
        answer = readonly_client.get("/console/tenants/", {"page": bad})
        assert answer.status_code == 200 and tenant_links(text(answer)) == [str(t.pk) for t in expected], bad
    searched = readonly_client.get("/console/tenants/", {"q": "t-", "page": "2"})
    assert 'href="?q=t-&amp;page=1"' in text(searched)


# ---- detail --------------------------------------------------------------------------------------------------------


def test_detail_shows_quota_against_usage_keys_caches_and_invoices(readonly_client):
    tenant = make_tenant("acme", max_caches=4, max_device_bytes=16 * GIB)
    node = make_node()
    one, _two = attach(tenant, "cache-one"), attach(tenant, "cache-two")
    Node.objects.filter(pk=node.pk).update(resident_snapshot={"caches": {str(one.pk): {"device": 100 * 1024}}})
    issued = issue_key(tenant, "caches:write", "usage:read", name="ci key")
    invoice = Invoice.objects.create(
        tenant=tenant,
        month=datetime(2026, 3, 1).date(),
        status="final",
        currency="USD",
        total=Decimal("12.34"),
        generated_at=timezone.now(),
    )
    for meter in ("device_gb_hour", "write_gb"):
        InvoiceLine.objects.create(
            invoice=invoice,
            cache=one,
            meter=meter,
            usage=1,
            quantity=1,
            unit_price=1,
            rate_effective_from=timezone.now(),
            amount=1,
        )
    page = readonly_client.get(f"/console/tenants/{tenant.pk}/")
    assert page.status_code == 200
    html = text(page)
    assert str(tenant.pk) in html and ">active</span>" in html
    assert "256 KiB of 16 GiB reserved (100 KiB resident)" in html
    assert 'max="17179869184" value="262144"' in html
    assert "0 B of 64 GiB reserved (0 B resident)" in html and "0 B of 256 GiB reserved" in html
    assert "2 of 4" in html and "0 of 100 outstanding" in html
    assert "cache-one" in html and "cache-two" in html and node.name in html
    assert issued.api_key.public_id in html and "ci key" in html and "caches:write, usage:read" in html
    assert "2026-03" in html and "12.34" in html and ">final</span>" in html
    assert re.search(r"<td>USD</td>\s*<td class=\"num hide-narrow\">2</td>", html)
    assert issued.raw_key not in html and issued.api_key.secret_hash not in html
    assert issued.raw_key.rsplit("_", 1)[-1] not in html  # nor the secret part alone
    assert 'class="empty">No metered usage in the last 30 days.' in html


def test_detail_draws_the_usage_chart_with_a_table(readonly_client):
    tenant = make_tenant("acme")
    make_node()
    cache = attach(tenant, "c")
    today = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    LedgerHour.objects.create(cache=cache, tenant=tenant, hour=today, device_byte_seconds=2 * GB_HOUR)
    LedgerHour.objects.create(
        cache=cache,
        tenant=tenant,
        hour=today + timedelta(hours=1),
        device_byte_seconds=GB_HOUR,
        ssd_byte_seconds=GB_HOUR // 4,
    )
    LedgerHour.objects.create(cache=cache, tenant=tenant, hour=today - timedelta(days=3), dram_byte_seconds=GB_HOUR)
    LedgerHour.objects.create(cache=cache, tenant=tenant, hour=today - timedelta(days=31), dram_byte_seconds=GB_HOUR)
    html = text(readonly_client.get(f"/console/tenants/{tenant.pk}/"))
    label = today.date().isoformat()
    assert f"<title>{label} device: 3 GB-hours</title>" in html and f"<title>{label} ssd: 0.25 GB-hours</title>" in html
    earlier = (today - timedelta(days=3)).date().isoformat()
    assert f"<title>{earlier} dram: 1 GB-hours</title>" in html
    assert len(re.findall(r"<rect ", html)) == 3  # the day 31 days ago is outside the chart
    assert 'role="img"' in html and "total 4.25 GB-hours" in html
    assert f'<tr><td>{label}</td><td class="num">3</td><td class="num">0</td><td class="num">0.25</td>' in html
    assert "No metered usage" not in html


@pytest.mark.parametrize(
    "path",
    [f"/console/tenants/{uuid.uuid4()}/", "/console/tenants/not-a-uuid/", f"/console/tenants/{uuid.uuid4()}/usage"],
)
def test_unknown_or_malformed_tenant_is_a_404_page(readonly_client, path):
    answer = readonly_client.get(path)
    assert answer.status_code == 404 and b"<html" in answer.content


def test_usage_fragment_for_htmx_polls(readonly_client):
    tenant = make_tenant("acme")
    fragment = readonly_client.get(
        f"/console/tenants/{tenant.pk}/usage", HTTP_HX_REQUEST="true", HTTP_X_CONSOLE_POLL="1"
    )
    assert fragment.status_code == 200
    body = text(fragment)
    assert body.lstrip().startswith('<div id="tenant-usage"') and "<html" not in body
    assert 'hx-trigger="every 5s"' in body and "X-Console-Poll" in body and "0 of 10" in body
    plain = readonly_client.get(f"/console/tenants/{tenant.pk}/usage")
    assert plain.status_code == 302 and plain["Location"] == f"/console/tenants/{tenant.pk}/"


# ---- quota ---------------------------------------------------------------------------------------------------------


def test_operator_sees_the_form_others_see_values_read_only(operator_client, readonly_client, compliance_client):
    tenant = make_tenant("acme", max_caches=7)
    form_action = f'action="/console/tenants/{tenant.pk}/quota"'
    operator_page = text(operator_client.get(f"/console/tenants/{tenant.pk}/"))
    assert form_action in operator_page and 'name="max_caches" value="7"' in operator_page
    assert 'name="max_device_bytes" value=""' in operator_page and "Blank: the default (16 GiB)." in operator_page
    for client in (readonly_client, compliance_client):
        page = text(client.get(f"/console/tenants/{tenant.pk}/"))
        assert form_action not in page and "/revoke" not in page and "/status" not in page
        assert '<td>Caches</td><td class="num">7</td><td>override</td>' in page
        assert "16 GiB (17179869184 bytes)</td><td>default</td>" in page


def test_quota_update_changes_the_limits_and_is_audited_as_the_console_user(operator_client):
    tenant = make_tenant("acme", max_requests_per_second=200)
    form = {
        **BLANK_QUOTA,
        "max_caches": "5",
        "max_device_bytes": "8 GiB",
        "max_dram_bytes": "1048576",
        "max_requests_per_second": "200",
    }
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/quota", form)
    assert answer["Location"] == f"/console/tenants/{tenant.pk}/#quota"
    page = followed_messages(operator_client, answer)
    assert (
        "Quota of acme updated: Caches: default (10) -&gt; 5; Device bytes: default (16 GiB) -&gt; 8 GiB; "
        "DRAM bytes: default (64 GiB) -&gt; 1 MiB."
    ) in page
    assert quota_row(tenant) == {
        "max_caches": 5,
        "max_device_bytes": 8 * GIB,
        "max_dram_bytes": 2**20,
        "max_ssd_bytes": None,
        "max_network_bytes": None,
        "max_requests_per_second": 200,
        "max_data_tokens_outstanding": None,
        "max_api_keys": None,
    }
    [event] = events(AuditAction.QUOTA_UPDATED, target_id=str(tenant.pk), actor_kind="user")
    assert event.actor_id == str(operator_client.user.pk)
    assert event.old_values == {"max_caches": None, "max_device_bytes": None, "max_dram_bytes": None}
    assert event.new_values == {"max_caches": 5, "max_device_bytes": 8 * GIB, "max_dram_bytes": 2**20}
    limits = tenant_selectors.quota_limits(tenant=Tenant.objects.get(pk=tenant.pk))
    assert (limits.max_caches, limits.max_device_bytes, limits.max_ssd_bytes) == (5, 8 * GIB, 256 * GIB)


def test_the_api_key_limit_is_on_the_form_and_set_through_it(operator_client, readonly_client):
    tenant = make_tenant("acme")
    page = text(operator_client.get(f"/console/tenants/{tenant.pk}/"))
    assert 'name="max_api_keys" value=""' in page and "Blank: the default (100)." in page
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/quota", {**BLANK_QUOTA, "max_api_keys": "5"})
    assert "API keys: default (100) -&gt; 5" in followed_messages(operator_client, answer)
    assert quota_row(tenant)["max_api_keys"] == 5
    assert '<td>API keys</td><td class="num">5</td><td>override</td>' in text(
        readonly_client.get(f"/console/tenants/{tenant.pk}/")
    )
    refused = operator_client.post(f"/console/tenants/{tenant.pk}/quota", {**BLANK_QUOTA, "max_api_keys": "100001"})
    assert refused.status_code == 400 and "Between 0 and 100000." in text(refused)


def test_blank_resets_a_limit_to_its_default(operator_client):
    tenant = make_tenant("acme", max_caches=3)
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/quota", BLANK_QUOTA)
    assert "Caches: 3 -&gt; default (10)" in followed_messages(operator_client, answer)
    assert quota_row(tenant)["max_caches"] is None


def test_an_unchanged_submission_changes_nothing_and_writes_no_event(operator_client):
    tenant = make_tenant("acme", max_caches=3, max_ssd_bytes=2 * GIB)
    before = len(events(AuditAction.QUOTA_UPDATED))
    form = {**BLANK_QUOTA, "max_caches": "3", "max_ssd_bytes": str(2 * GIB)}
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/quota", form)
    assert "Quota of acme: nothing changed." in followed_messages(operator_client, answer)
    assert len(events(AuditAction.QUOTA_UPDATED)) == before


@pytest.mark.parametrize(
    "field,value,error",
    [
        ("max_caches", "-1", "A whole number"),
        ("max_caches", str(10**30), "Between 0 and 10000."),
        ("max_caches", "abc", "A whole number"),
        ("max_caches", "1.5", "A whole number"),
        ("max_caches", "10001", "Between 0 and 10000."),
        ("max_requests_per_second", "0", "Between 1 and 100000."),
        ("max_device_bytes", "-1", "A whole number of bytes"),
        ("max_device_bytes", "1.5 GiB", "A whole number of bytes"),
        ("max_device_bytes", "2 PiB", "Between 0 and 1125899906842624"),
        ("max_device_bytes", "4 XB", "A whole number of bytes"),
        ("max_ssd_bytes", str(10**30), "Between 0 and"),
        ("max_data_tokens_outstanding", "1e3", "A whole number"),
        ("max_data_tokens_outstanding", "\u0661\u0662", "A whole number"),  # Arabic-Indic digits
    ],
)
def test_bad_quota_input_is_a_400_with_the_fields_error_and_changes_nothing(operator_client, field, value, error):
    tenant = make_tenant("acme", max_caches=3)
    before, events_before = quota_row(tenant), len(events(AuditAction.QUOTA_UPDATED))
    form = {**BLANK_QUOTA, "max_caches": "3", "max_dram_bytes": "1 GiB", field: value}  # dram would change
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/quota", form)
    assert answer.status_code == 400
    html = text(answer)
    assert re.search(rf'id="id_{field}-error">[^<]*{re.escape(error)}', html), html[-3000:]
    assert "The quota was not changed" in html and 'aria-invalid="true"' in html
    assert quota_row(tenant) == before and len(events(AuditAction.QUOTA_UPDATED)) == events_before


@pytest.mark.parametrize("make_client", ["readonly_client", "compliance_client"])
def test_non_operators_cannot_change_quota_revoke_keys_or_suspend(request, make_client):
    client = request.getfixturevalue(make_client)
    tenant = make_tenant("acme", max_caches=3)
    key = issue_key(tenant).api_key
    answers = [
        client.post(f"/console/tenants/{tenant.pk}/quota", {**BLANK_QUOTA, "max_caches": "9"}),
        client.get(f"/console/tenants/{tenant.pk}/keys/{key.pk}/revoke"),
        client.post(f"/console/tenants/{tenant.pk}/keys/{key.pk}/revoke"),
        client.get(f"/console/tenants/{tenant.pk}/status", {"status": "suspended"}),
        client.post(f"/console/tenants/{tenant.pk}/status", {"status": "suspended"}),
    ]
    assert [answer.status_code for answer in answers] == [403] * 5
    assert quota_row(tenant)["max_caches"] == 3
    key.refresh_from_db()
    assert key.revoked_at is None and Tenant.objects.get(pk=tenant.pk).status == "active"
    assert not events(AuditAction.QUOTA_UPDATED, actor_kind="user")
    assert not events(AuditAction.KEY_REVOKED) and not events(AuditAction.TENANT_UPDATED)


def test_quota_form_needs_its_csrf_token(console_client):
    client = console_client(roles.OPERATOR, csrf=True)
    tenant = make_tenant("acme")
    client.get(f"/console/tenants/{tenant.pk}/")
    refused = client.post(f"/console/tenants/{tenant.pk}/quota", {**BLANK_QUOTA, "max_caches": "2"})
    assert refused.status_code == 403 and quota_row(tenant)["max_caches"] is None
    token = csrf_token(client)
    accepted = client.post(
        f"/console/tenants/{tenant.pk}/quota", {**BLANK_QUOTA, "max_caches": "2", "csrfmiddlewaretoken": token}
    )
    assert accepted.status_code == 302 and quota_row(tenant)["max_caches"] == 2


def test_quota_is_a_post_and_unknown_tenants_are_404(operator_client):
    tenant = make_tenant("acme")
    assert operator_client.get(f"/console/tenants/{tenant.pk}/quota").status_code == 405
    assert operator_client.post(f"/console/tenants/{uuid.uuid4()}/quota", BLANK_QUOTA).status_code == 404


def test_the_api_enforces_a_quota_set_in_the_console(operator_client):
    tenant = make_tenant("acme", max_requests_per_second=100_000)
    raw_key = issue_key(tenant, "caches:write").raw_key
    body = {"name": "c1", "spec": SPEC, "capacity": {"device": CACHE_DEVICE_BYTES, "dram": 0, "ssd": 0}}
    answer = operator_client.post(
        f"/console/tenants/{tenant.pk}/quota", {**BLANK_QUOTA, "max_caches": "0", "max_requests_per_second": "100000"}
    )
    assert answer.status_code == 302
    assert tenant_selectors.quota_limits(tenant=Tenant.objects.get(pk=tenant.pk)).max_caches == 0
    refused = bearer(raw_key).post("/api/v1/caches", body, format="json")
    assert refused.status_code == 403, refused.content
    assert refused.json()["error"]["code"] == "quota_exceeded"
    assert refused.json()["error"]["details"]["limit"] == "max_caches"
    assert not Cache.objects.filter(tenant=tenant).exists()


# ---- key revoke ------------------------------------------------------------------------------------------------------


def test_operator_revokes_a_key_after_confirming_and_the_api_refuses_it(operator_client):
    tenant = make_tenant("acme")
    issued = issue_key(tenant, "usage:read", name="old laptop")
    assert bearer(issued.raw_key).get("/api/v1/whoami").status_code == 200
    url = f"/console/tenants/{tenant.pk}/keys/{issued.api_key.pk}/revoke"
    detail = text(operator_client.get(f"/console/tenants/{tenant.pk}/"))
    assert f'href="{url}"' in detail
    confirm = operator_client.get(url)
    assert confirm.status_code == 200 and f'action="{url}"' in text(confirm)
    assert "Revoke key" in text(confirm) and issued.raw_key not in text(confirm)
    assert "data tokens it minted are revoked" in text(confirm)  # the whole consequence, not only the key
    assert ApiKey.objects.get(pk=issued.api_key.pk).revoked_at is None  # GET only asks
    page = followed_messages(operator_client, operator_client.post(url))
    assert f"The key kc_live_{issued.api_key.public_id}_… (old laptop) was revoked: active -&gt; revoked." in page
    assert ">revoked</span>" in page and f'href="{url}"' not in page  # no Revoke button for a revoked key
    assert ApiKey.objects.get(pk=issued.api_key.pk).state == "revoked"
    [event] = events(AuditAction.KEY_REVOKED, target_id=str(issued.api_key.pk))
    assert (event.actor_kind, event.actor_id) == ("user", str(operator_client.user.pk))
    assert bearer(issued.raw_key).get("/api/v1/whoami").status_code == 401
    again = followed_messages(operator_client, operator_client.post(url))
    assert "was already revoked: nothing changed." in again and len(events(AuditAction.KEY_REVOKED)) == 1


def test_another_tenants_key_is_a_404_and_stays_active(operator_client):
    mine, theirs = make_tenant("acme"), make_tenant("globex")
    their_key = issue_key(theirs).api_key
    for answer in (
        operator_client.get(f"/console/tenants/{mine.pk}/keys/{their_key.pk}/revoke"),
        operator_client.post(f"/console/tenants/{mine.pk}/keys/{their_key.pk}/revoke"),
        operator_client.post(f"/console/tenants/{mine.pk}/keys/{uuid.uuid4()}/revoke"),
        operator_client.post(f"/console/tenants/{mine.pk}/keys/not-a-uuid/revoke"),
    ):
        assert answer.status_code == 404
    assert ApiKey.objects.get(pk=their_key.pk).revoked_at is None and not events(AuditAction.KEY_REVOKED)


# ---- suspend / reactivate --------------------------------------------------------------------------------------------


def test_operator_suspends_and_reactivates_a_tenant(operator_client):
    tenant = make_tenant("acme")
    raw_key = issue_key(tenant, "usage:read").raw_key
    url = f"/console/tenants/{tenant.pk}/status"
    confirm = operator_client.get(url, {"status": "suspended"})
    assert confirm.status_code == 200 and 'name="status" value="suspended"' in text(confirm)
    assert Tenant.objects.get(pk=tenant.pk).status == "active"
    page = followed_messages(operator_client, operator_client.post(url, {"status": "suspended"}))
    assert "Tenant acme: active -&gt; suspended." in page and "Reactivate tenant" in page
    assert bearer(raw_key).get("/api/v1/whoami").status_code == 401
    [event] = events(AuditAction.TENANT_UPDATED, target_id=str(tenant.pk))
    assert (event.actor_id, event.new_values) == (str(operator_client.user.pk), {"status": "suspended"})
    page = followed_messages(operator_client, operator_client.post(url, {"status": "active"}))
    assert "Tenant acme: suspended -&gt; active." in page
    assert bearer(raw_key).get("/api/v1/whoami").status_code == 200


@pytest.mark.parametrize("status", ["erased", "", "ACTIVE"])
def test_unknown_status_is_a_400_and_changes_nothing(operator_client, status):
    tenant = make_tenant("acme")
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/status", {"status": status})
    assert answer.status_code == 400 and Tenant.objects.get(pk=tenant.pk).status == "active"


def test_an_erasing_tenant_cannot_be_reactivated(operator_client):
    tenant = make_tenant("acme")
    Tenant.objects.filter(pk=tenant.pk).update(status="erasing")
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/status", {"status": "active"})
    assert answer.status_code == 409 and Tenant.objects.get(pk=tenant.pk).status == "erasing"


def test_the_console_and_the_rest_api_parse_quota_values_alike():
    """One parser (tenants.quota_values): what one takes, the other takes to the same number; what one refuses, so
    does the other. A form has no types: the digits typed there are the JSON integer the API takes. The console
    shows a limit in a form its parser takes back."""
    from console.forms import limit_text, parse_limit
    from tenants.quota_values import QuotaValueError, quota_value_parse
    from tenants.services import QUOTA_BOUNDS

    for field, json_value, text in [
        ("max_device_bytes", "1GiB", "1GiB"),
        ("max_device_bytes", "512 MiB", "512 MiB"),
        ("max_caches", 7, "7"),
        ("max_device_bytes", 1048576, "1048576"),
        ("max_dram_bytes", "3tib", "3tib"),
        ("max_device_bytes", "007", "007"),
        ("max_device_bytes", "1.5GiB", "1.5GiB"),
        ("max_caches", "5GiB", "5GiB"),
        ("max_ssd_bytes", "1 GB", "1 GB"),
        ("max_caches", -3, "-3"),
    ]:
        try:
            rest = quota_value_parse(field, json_value, bounds=QUOTA_BOUNDS[field])
        except QuotaValueError:
            rest = None
        try:
            console = parse_limit(field, text)
        except Exception:  # noqa: BLE001 - forms.ValidationError
            console = None
        assert console == rest, (field, json_value, text)
    for field, (low, high) in QUOTA_BOUNDS.items():
        for value in (low, high, high // 2):
            assert parse_limit(field, limit_text(field, value)) == value, (field, value)
