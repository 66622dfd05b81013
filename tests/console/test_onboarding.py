"""Console onboarding: a new tenant with its initial quota (tenants.services.tenant_create, as the REST API's POST
/api/v1/admin/tenants; audited as the console user; bad input -> 400, the form, nothing created), issuing an API key
(tenants.services.api_key_issue, as POST /api/v1/keys; the secret on the answer page only, no-store, never again:
not on a reload, not in the session, not in a log; the key works against the REST API), the role matrix (403,
nothing changed), and the warning on a tenant's pages while its erasure is scheduled or running."""

from __future__ import annotations

import logging
import re
import uuid

import pytest
from django.contrib.sessions.models import Session

from audit.actions import AuditAction
from console import roles
from console.pages.tenant_onboarding import KEY_NONCES
from privacy import services as privacy_services
from privacy.models import ErasureJob
from tenants import services as tenant_services
from tenants.models import ApiKey, Tenant
from tests.console.conftest import csrf_token
from tests.console.test_tenants import BLANK_QUOTA, GIB, bearer, events, make_tenant, quota_row, text

pytestmark = pytest.mark.django_db
RAW_KEY = re.compile(r"kc_live_[A-Za-z0-9_-]+")


def new_tenant_form(name: str, **quota: str) -> dict:
    return {"name": name, **BLANK_QUOTA, **quota}


def key_form(client, tenant: Tenant) -> dict:
    """The hidden fields of the key form as a GET renders it (its one-time nonce)."""
    page = client.get(f"/console/tenants/{tenant.pk}/keys/new")
    assert page.status_code == 200
    [nonce] = re.findall(r'name="nonce" value="([^"]+)"', text(page))
    return {"nonce": nonce}


def issue_in_console(client, tenant: Tenant, **fields):
    return client.post(
        f"/console/tenants/{tenant.pk}/keys/new", {**key_form(client, tenant), "scopes": ["caches:write"], **fields}
    )


def raw_key_on(page: str) -> str:
    [raw_key] = set(RAW_KEY.findall(page))
    return raw_key


# ---- new tenant ------------------------------------------------------------------------------------------------------


def test_operators_see_a_new_tenant_button_others_do_not(operator_client, readonly_client, compliance_client):
    assert 'href="/console/tenants/new"' in text(operator_client.get("/console/tenants/"))
    for client in (readonly_client, compliance_client):
        assert 'href="/console/tenants/new"' not in text(client.get("/console/tenants/"))


def test_the_new_tenant_form_shows_the_quota_fields_with_their_defaults(operator_client):
    page = operator_client.get("/console/tenants/new")
    assert page.status_code == 200 and page["Cache-Control"] == "no-store"
    html = text(page)
    assert html.count("<h1>") == 1 and "<h1>New tenant</h1>" in html
    assert '<label for="id_name">Name</label>' in html
    assert '<label for="id_max_device_bytes">Device bytes</label>' in html
    assert "Blank: the default (16 GiB)." in html and "Blank: the default (10)." in html
    assert 'name="max_api_keys" value=""' in html


def test_operator_creates_a_tenant_with_its_quota_through_the_service_and_lands_on_its_page(operator_client):
    form = new_tenant_form("acme-robotics", max_caches="5", max_device_bytes="8 GiB", max_dram_bytes="1048576")
    answer = operator_client.post("/console/tenants/new", form)
    tenant = Tenant.objects.get(name="acme-robotics")
    assert answer.status_code == 302 and answer["Location"] == f"/console/tenants/{tenant.pk}/"
    assert tenant.status == "active"
    assert quota_row(tenant) == {
        **dict.fromkeys(tenant_services.QUOTA_BOUNDS),
        "max_caches": 5,
        "max_device_bytes": 8 * GIB,
        "max_dram_bytes": 2**20,
    }
    [created] = events(AuditAction.TENANT_CREATED, target_id=str(tenant.pk))
    assert (created.actor_kind, created.actor_id) == ("user", str(operator_client.user.pk))
    assert created.new_values == {"name": "acme-robotics", "status": "active"}
    [quota] = events(AuditAction.QUOTA_UPDATED, target_id=str(tenant.pk))
    assert (quota.actor_kind, quota.actor_id) == ("user", str(operator_client.user.pk))
    assert quota.new_values == {"max_caches": 5, "max_device_bytes": 8 * GIB, "max_dram_bytes": 2**20}
    assert created.seq < quota.seq
    page = text(operator_client.get(answer["Location"]))
    assert "Tenant acme-robotics created." in page and "<h1>acme-robotics</h1>" in page
    assert f'href="/console/tenants/{tenant.pk}/keys/new"' in page


def test_a_tenant_with_every_limit_blank_keeps_the_defaults_and_writes_no_quota_event(operator_client):
    answer = operator_client.post("/console/tenants/new", new_tenant_form("  initech  "))
    tenant = Tenant.objects.get(name="initech")  # stripped, as the service normalises
    assert answer.status_code == 302
    assert quota_row(tenant) == dict.fromkeys(tenant_services.QUOTA_BOUNDS)
    assert len(events(AuditAction.TENANT_CREATED, target_id=str(tenant.pk))) == 1
    assert not events(AuditAction.QUOTA_UPDATED, target_id=str(tenant.pk))


@pytest.mark.parametrize(
    "form,field,error",
    [
        (new_tenant_form("acme"), "name", "A tenant with this name exists"),
        (new_tenant_form("\u0430cme"), "name", "looks like the existing tenant name “acme”"),  # Cyrillic а
        (new_tenant_form("acrne"), "name", "looks like the existing tenant name “acme”"),  # rn looks like m
        (new_tenant_form(""), "name", "This field is required."),
        ({}, "name", "This field is required."),
        (new_tenant_form("   "), "name", "This field is required."),
        (new_tenant_form("evil\u202eemca"), "name", "U+202E"),
        (new_tenant_form("x" * 101), "name", "at most 100 characters"),
        (new_tenant_form("globex", max_caches="-1"), "max_caches", "A whole number"),
        (new_tenant_form("globex", max_device_bytes="2 PiB"), "max_device_bytes", "Between 0 and 1125899906842624"),
        (new_tenant_form("globex", max_requests_per_second="0"), "max_requests_per_second", "Between 1 and 100000."),
        (new_tenant_form("globex", max_ssd_bytes="lots"), "max_ssd_bytes", "A whole number of bytes"),
    ],
)
def test_bad_input_is_a_400_with_the_form_and_creates_nothing(operator_client, form, field, error):
    make_tenant("acme")
    tenants_before = set(Tenant.objects.values_list("pk", flat=True))
    created_before, quota_before = len(events(AuditAction.TENANT_CREATED)), len(events(AuditAction.QUOTA_UPDATED))
    answer = operator_client.post("/console/tenants/new", form)
    assert answer.status_code == 400
    html = text(answer)
    assert "The tenant was not created" in html and 'aria-invalid="true"' in html
    assert re.search(rf'id="id_{field}-error">[^<]*{re.escape(error)}', html), html[-3000:]
    assert set(Tenant.objects.values_list("pk", flat=True)) == tenants_before
    assert len(events(AuditAction.TENANT_CREATED)) == created_before
    assert len(events(AuditAction.QUOTA_UPDATED)) == quota_before


def test_a_refused_form_keeps_what_was_typed(operator_client):
    answer = operator_client.post("/console/tenants/new", new_tenant_form("globex", max_caches="7", max_dram_bytes="x"))
    html = text(answer)
    assert answer.status_code == 400
    assert 'name="name"' in html and 'value="globex"' in html and 'name="max_caches" value="7"' in html


def test_the_new_tenant_form_needs_its_csrf_token(console_client):
    client = console_client(roles.OPERATOR, csrf=True)
    client.get("/console/tenants/new")
    assert client.post("/console/tenants/new", new_tenant_form("acme")).status_code == 403
    assert not Tenant.objects.filter(name="acme").exists()
    token = {"csrfmiddlewaretoken": csrf_token(client)}
    assert client.post("/console/tenants/new", {**new_tenant_form("acme"), **token}).status_code == 302


@pytest.mark.parametrize("make_client", ["readonly_client", "compliance_client"])
def test_non_operators_can_neither_create_tenants_nor_issue_keys(request, make_client):
    client = request.getfixturevalue(make_client)
    tenant = make_tenant("acme")
    answers = [
        client.get("/console/tenants/new"),
        client.post("/console/tenants/new", new_tenant_form("globex", max_caches="3")),
        client.get(f"/console/tenants/{tenant.pk}/keys/new"),
        client.post(f"/console/tenants/{tenant.pk}/keys/new", {"scopes": ["caches:write"], "nonce": "x"}),
    ]
    assert [answer.status_code for answer in answers] == [403] * 4
    assert "Your console role does not allow this." in text(answers[1])
    assert list(Tenant.objects.values_list("name", flat=True)) == ["acme"]
    assert not ApiKey.objects.exists() and not events(AuditAction.KEY_ISSUED)
    assert not events(AuditAction.TENANT_CREATED, actor_kind="user")
    page = text(client.get(f"/console/tenants/{tenant.pk}/"))
    assert "/keys/new" not in page and "Issue API key" not in page


# ---- issue an API key ------------------------------------------------------------------------------------------------


def test_the_key_form_offers_the_apis_scopes(operator_client):
    tenant = make_tenant("acme")
    html = text(operator_client.get(f"/console/tenants/{tenant.pk}/keys/new"))
    for scope in ("caches:read", "caches:write", "keys:read", "keys:write", "usage:read", "audit:write"):
        assert f'name="scopes" value="{scope}"' in html
    assert re.search(r'value="caches:write"\s+checked', html)  # an engine's key by default
    assert "<legend>Scopes</legend>" in html and '<label for="id_expires_in_days">' in html


def test_operator_issues_a_key_shown_once_that_authenticates_against_the_api(operator_client, caplog):
    tenant = make_tenant("acme")
    caplog.set_level(logging.DEBUG)
    answer = issue_in_console(
        operator_client, tenant, name="prod engines", scopes=["caches:write", "usage:read"], expires_in_days="30"
    )
    assert answer.status_code == 200 and answer["Cache-Control"] == "no-store"
    html = text(answer)
    raw_key = raw_key_on(html)
    assert "shown only this once" in html and "will not show it" in html
    assert f"export KCAAS_URL=http://testserver KCAAS_API_KEY={raw_key}" in html
    assert 'data-copy="new-key"' in html and 'data-copy="export-line"' in html
    assert html.count("<h1>") == 1
    api_key = ApiKey.objects.get(tenant=tenant)
    assert raw_key.startswith(f"kc_live_{api_key.public_id}_")
    assert (api_key.name, api_key.scopes) == ("prod engines", ["caches:write", "usage:read"])
    assert api_key.expires_at is not None
    [event] = events(AuditAction.KEY_ISSUED, target_id=str(api_key.pk))
    assert (event.actor_kind, event.actor_id) == ("user", str(operator_client.user.pk))
    assert event.new_values == {"public_id": api_key.public_id, "scopes": ["caches:write", "usage:read"]}

    whoami = bearer(raw_key).get("/api/v1/whoami")
    assert whoami.status_code == 200, whoami.content
    assert whoami.json() == {
        "kind": "tenant_key",
        "tenant_id": str(tenant.pk),
        "key_id": str(api_key.pk),
        "scopes": ["caches:write", "usage:read"],
    }

    secret = raw_key.split("_", 3)[3]
    detail = text(operator_client.get(f"/console/tenants/{tenant.pk}/"))
    assert api_key.public_id in detail and secret not in detail and raw_key not in detail
    again = text(operator_client.get(f"/console/tenants/{tenant.pk}/keys/new"))
    assert secret not in again
    assert secret not in caplog.text
    for session in Session.objects.all():
        assert secret not in str(session.get_decoded())
    assert secret not in str(events(AuditAction.KEY_ISSUED)[0].__dict__)


def test_a_resubmitted_key_form_issues_nothing_and_shows_no_secret(operator_client):
    tenant = make_tenant("acme")
    form = {**key_form(operator_client, tenant), "scopes": ["caches:write"]}
    first = operator_client.post(f"/console/tenants/{tenant.pk}/keys/new", form)
    secret = raw_key_on(text(first)).split("_", 3)[3]
    reload = operator_client.post(f"/console/tenants/{tenant.pk}/keys/new", form)  # the browser's "resend"
    assert reload.status_code == 409 and reload["Cache-Control"] == "no-store"
    assert "no key was issued now" in text(reload) and secret not in text(reload)
    assert not RAW_KEY.search(text(reload))
    assert ApiKey.objects.filter(tenant=tenant).count() == 1 and len(events(AuditAction.KEY_ISSUED)) == 1
    no_nonce = operator_client.post(f"/console/tenants/{tenant.pk}/keys/new", {"scopes": ["caches:write"]})
    assert no_nonce.status_code == 409 and ApiKey.objects.filter(tenant=tenant).count() == 1


def test_the_nonces_kept_in_the_session_are_bounded(operator_client):
    tenant = make_tenant("acme")
    for _ in range(25):
        operator_client.get(f"/console/tenants/{tenant.pk}/keys/new")
    assert len(operator_client.session[KEY_NONCES]) == 20


@pytest.mark.parametrize(
    "fields,field,error",
    [
        ({"scopes": []}, "scopes", "Choose at least one scope."),
        ({"scopes": ["caches:admin"]}, "scopes", "Select a valid choice"),
        ({"expires_in_days": "0"}, "expires_in_days", "greater than or equal to 1"),
        ({"expires_in_days": "1.5"}, "expires_in_days", "Enter a whole number."),
        ({"expires_in_days": "99999"}, "expires_in_days", "less than or equal to 1830"),
        ({"name": "bad\u200bname"}, "name", "U+200B"),
        ({"name": "x" * 101}, "name", "at most 100 characters"),
    ],
)
def test_bad_key_input_is_a_400_and_issues_nothing(operator_client, fields, field, error):
    tenant = make_tenant("acme")
    answer = issue_in_console(operator_client, tenant, **fields)
    assert answer.status_code == 400
    html = text(answer)
    assert "No key was issued" in html and not RAW_KEY.search(html)
    error_id = "scopes-error" if field == "scopes" else f"id_{field}-error"
    assert re.search(rf'id="{error_id}">[^<]*{re.escape(error)}', html), html[-3000:]
    assert not ApiKey.objects.exists() and not events(AuditAction.KEY_ISSUED)
    assert re.search(r'name="nonce" value="[^"]+"', html)  # a fresh form, usable once


def test_a_tenant_at_its_key_limit_gets_no_key(operator_client):
    tenant = make_tenant("acme", max_api_keys=0)
    answer = issue_in_console(operator_client, tenant)
    assert answer.status_code == 403
    assert "at most 0 usable API keys" in text(answer) and not RAW_KEY.search(text(answer))
    assert not ApiKey.objects.exists()


def test_unknown_tenant_is_a_404_and_an_erasing_one_gets_no_key(operator_client):
    assert operator_client.get(f"/console/tenants/{uuid.uuid4()}/keys/new").status_code == 404
    tenant = make_tenant("acme")
    form = key_form(operator_client, tenant)
    Tenant.objects.filter(pk=tenant.pk).update(status="erasing")
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/keys/new", {**form, "scopes": ["caches:write"]})
    assert answer.status_code == 409 and not ApiKey.objects.exists()
    assert "Issue API key" not in text(operator_client.get(f"/console/tenants/{tenant.pk}/"))


# ---- erasure warning -------------------------------------------------------------------------------------------------


def test_a_scheduled_erasure_is_announced_on_the_tenant_its_key_form_and_the_list(operator_client, compliance_client):
    tenant, other = make_tenant("acme"), make_tenant("globex")
    job, _ = privacy_services.erasure_request(tenant_id=tenant.pk, requested_by="user:1")
    when = job.scheduled_for.strftime("%Y-%m-%d %H:%M")
    for client in (operator_client, compliance_client):
        detail = text(client.get(f"/console/tenants/{tenant.pk}/"))
        assert "Erasure scheduled for <time datetime=" in detail and f"{when} UTC" in detail
        assert "Once it runs it cannot be undone." in detail and 'href="/console/gdpr/"' in detail
        assert 'id="erasure-warning"' not in text(client.get(f"/console/tenants/{other.pk}/"))
    assert 'id="erasure-warning"' in text(operator_client.get(f"/console/tenants/{tenant.pk}/keys/new"))
    rows = text(operator_client.get("/console/tenants/")).split("<tr>")
    [acme_row] = [row for row in rows if ">acme</a>" in row]
    [globex_row] = [row for row in rows if ">globex</a>" in row]
    assert "erasure scheduled</span>" in acme_row and "runs <time" in acme_row and when in acme_row
    assert "erasure scheduled" not in globex_row

    privacy_services.erasure_cancel(tenant_id=tenant.pk)
    assert 'id="erasure-warning"' not in text(operator_client.get(f"/console/tenants/{tenant.pk}/"))
    assert "erasure scheduled" not in text(operator_client.get("/console/tenants/"))


def test_a_running_erasure_says_it_can_no_longer_be_cancelled(operator_client):
    tenant = make_tenant("acme")
    job, _ = privacy_services.erasure_request(tenant_id=tenant.pk, requested_by="user:1")
    ErasureJob.objects.filter(pk=job.pk).update(state="running")
    detail = text(operator_client.get(f"/console/tenants/{tenant.pk}/"))
    assert "Erasure running" in detail and "can no longer be cancelled" in detail
    assert "erasure scheduled" not in text(operator_client.get("/console/tenants/"))
