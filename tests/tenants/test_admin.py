"""Staff administration of tenants and quotas, and the kcaas_create_tenant command."""

import io
import uuid

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from tenants import selectors, services
from tenants.models import Quota, Tenant

from .conftest import assert_error, key_client, run_concurrently

TENANTS_URL = "/api/v1/admin/tenants"


def _admin_endpoints(tenant_id):
    return [
        ("get", TENANTS_URL, None),
        ("post", TENANTS_URL, {"name": "x"}),
        ("get", f"{TENANTS_URL}/{tenant_id}", None),
        ("patch", f"{TENANTS_URL}/{tenant_id}", {"status": "suspended"}),
        ("get", f"{TENANTS_URL}/{tenant_id}/quota", None),
        ("patch", f"{TENANTS_URL}/{tenant_id}/quota", {"max_caches": 1}),
    ]


def _call(client, method, url, body):
    return getattr(client, method)(url, body, format="json") if body is not None else getattr(client, method)(url)


@pytest.mark.parametrize("index", range(6))
def test_admin_endpoints_are_staff_only(tenant, tenant_client, anon_client, user_client, index):
    method, url, body = _admin_endpoints(tenant.pk)[index]
    assert_error(_call(anon_client, method, url, body), 401, "not_authenticated")
    assert_error(_call(user_client, method, url, body), 403, "permission_denied")
    assert_error(_call(tenant_client, method, url, body), 403, "permission_denied")  # even with every scope
    tenant.refresh_from_db()
    assert tenant.status == "active" and Tenant.objects.count() == 1


def test_staff_create_list_and_get_tenants(staff_client):
    created = staff_client.post(TENANTS_URL, {"name": "  globex  "}, format="json")
    assert created.status_code == 201
    body = created.json()
    assert set(body) == {"id", "name", "status", "created_at"}
    assert body["name"] == "globex" and body["status"] == "active"
    assert Quota.objects.filter(tenant_id=body["id"]).exists()
    staff_client.post(TENANTS_URL, {"name": "initech"}, format="json")
    listed = staff_client.get(TENANTS_URL, {"limit": 1}).json()
    assert listed["count"] == 2 and [t["name"] for t in listed["results"]] == ["globex"]
    assert staff_client.get(f"{TENANTS_URL}/{body['id']}").json() == body
    assert_error(staff_client.get(f"{TENANTS_URL}/{uuid.uuid4()}"), 404, "not_found")


@pytest.mark.parametrize("body", [{}, {"name": ""}, {"name": "   "}, {"name": "x" * 101}, {"name": ["a"]}, []])
def test_tenant_name_validation(staff_client, body):
    assert_error(staff_client.post(TENANTS_URL, body, format="json"), 400, "validation_error")


def test_duplicate_tenant_name_is_409(staff_client, tenant):
    assert_error(staff_client.post(TENANTS_URL, {"name": "acme"}, format="json"), 409, "tenant_name_taken")


@pytest.mark.django_db(transaction=True)
def test_concurrent_creates_of_one_name_make_one_tenant():
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    staff = get_user_model().objects.create_user("ops2", is_staff=True)

    def create():
        client = APIClient()
        client.force_authenticate(staff)
        return client.post(TENANTS_URL, {"name": "racy"}, format="json").status_code

    assert sorted(run_concurrently(create, [()] * 5)) == [201, 409, 409, 409, 409]
    assert Tenant.objects.filter(name="racy").count() == 1


def test_suspend_and_reactivate(staff_client, tenant, tenant_client):
    url = f"{TENANTS_URL}/{tenant.pk}"
    assert staff_client.patch(url, {"status": "suspended"}, format="json").json()["status"] == "suspended"
    assert_error(tenant_client.get("/api/v1/keys"), 401, "tenant_inactive")
    assert staff_client.patch(url, {"status": "active"}, format="json").json()["status"] == "active"
    assert tenant_client.get("/api/v1/keys").status_code == 200
    assert_error(staff_client.patch(url, {"status": "erased"}, format="json"), 400, "validation_error")
    Tenant.objects.filter(pk=tenant.pk).update(status="erasing")
    assert_error(staff_client.patch(url, {"status": "active"}, format="json"), 409, "tenant_inactive")


# ---- quotas --------------------------------------------------------------------------------------------------------


def test_quota_defaults_then_overrides_then_reset(staff_client, tenant, settings):
    url = f"{TENANTS_URL}/{tenant.pk}/quota"
    defaults = settings.KCAAS_QUOTA_DEFAULTS
    body = staff_client.get(url).json()
    assert body["tenant_id"] == str(tenant.pk)
    assert {k: body[k] for k in defaults} == defaults
    assert set(body["overrides"].values()) == {None}

    patched = staff_client.patch(url, {"max_caches": 3, "max_device_bytes": 2**40}, format="json").json()
    assert patched["max_caches"] == 3 and patched["max_device_bytes"] == 2**40
    assert patched["overrides"]["max_caches"] == 3 and patched["max_dram_bytes"] == defaults["max_dram_bytes"]
    partial = staff_client.patch(url, {"max_requests_per_second": 7}, format="json").json()
    assert partial["max_caches"] == 3 and partial["max_requests_per_second"] == 7  # untouched fields stay
    reset = staff_client.patch(url, {"max_caches": None}, format="json").json()
    assert reset["max_caches"] == defaults["max_caches"] and reset["overrides"]["max_caches"] is None


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_caches": -1}, "max_caches"),
        ({"max_device_bytes": 2**63}, "max_device_bytes"),
        ({"max_ssd_bytes": 10**400}, "max_ssd_bytes"),
        ({"max_dram_bytes": 1e30}, "max_dram_bytes"),
        ({"max_caches": "ten"}, "max_caches"),
        ({"max_caches": 1.5}, "max_caches"),
        ({"max_caches": True}, "max_caches"),
        ({"max_caches": [1]}, "max_caches"),
        ({"max_requests_per_second": 0}, "max_requests_per_second"),
        ({"max_data_tokens_outstanding": 10**7}, "max_data_tokens_outstanding"),
        ({"max_cache": 1}, "max_cache"),  # a typo is refused, not ignored
    ],
)
def test_quota_patch_validation(staff_client, tenant, body, field):
    url = f"{TENANTS_URL}/{tenant.pk}/quota"
    error = assert_error(staff_client.patch(url, body, format="json"), 400, "validation_error")
    assert field in error["details"]["fields"]
    assert set(selectors.quota_overrides(tenant=tenant).values()) == {None}


def test_quota_patch_with_a_non_object_is_400(staff_client, tenant):
    assert_error(staff_client.patch(f"{TENANTS_URL}/{tenant.pk}/quota", [1], format="json"), 400, "validation_error")


def test_quota_of_an_unknown_tenant_is_404(staff_client, db):
    assert_error(staff_client.get(f"{TENANTS_URL}/{uuid.uuid4()}/quota"), 404, "not_found")
    response = staff_client.patch(f"{TENANTS_URL}/{uuid.uuid4()}/quota", {"max_caches": 1}, format="json")
    assert_error(response, 404, "not_found")


@pytest.mark.parametrize("limits", [{"max_caches": -1}, {"max_caches": "1"}, {"nonsense": 1}, {"max_caches": 2**60}])
def test_quota_update_service_validates_too(tenant, limits):
    with pytest.raises(services.ValidationFailed) as caught:
        services.quota_update(tenant=tenant, **limits)
    assert caught.value.status_code == 400 and set(caught.value.details["fields"]) == set(limits)


def test_quota_limits_merge_defaults(tenant):
    with override_settings(KCAAS_QUOTA_DEFAULTS={**selectors.settings.KCAAS_QUOTA_DEFAULTS, "max_caches": 42}):
        assert selectors.quota_limits(tenant=tenant).max_caches == 42
        services.quota_update(tenant=tenant, max_caches=5)
        tenant = Tenant.objects.get(pk=tenant.pk)
        limits = selectors.quota_limits(tenant=tenant)
        assert limits.max_caches == 5 and limits.capacity_bytes()["device"] == limits.max_device_bytes


def test_quota_limits_without_a_quota_row(tenant):
    Quota.objects.filter(tenant=tenant).delete()
    tenant = Tenant.objects.get(pk=tenant.pk)
    assert selectors.quota_limits(tenant=tenant).max_caches == selectors.settings.KCAAS_QUOTA_DEFAULTS["max_caches"]
    services.quota_update(tenant=tenant, max_caches=2)  # recreates the row
    assert Quota.objects.get(tenant=tenant).max_caches == 2


@pytest.mark.django_db(transaction=True)
def test_tenant_lock_needs_a_transaction(make_tenant):
    tenant = make_tenant()
    with pytest.raises(RuntimeError):
        services.tenant_lock(tenant_id=tenant.pk)


# ---- management command ----------------------------------------------------------------------------------------


def test_create_tenant_command_prints_a_working_key(db):
    out, err = io.StringIO(), io.StringIO()
    call_command("kcaas_create_tenant", "demo", "--scopes", "keys:read", "caches:write", stdout=out, stderr=err)
    raw = out.getvalue().strip()
    assert raw.startswith("kc_live_") and "\n" not in raw
    assert key_client(raw).get("/api/v1/keys").status_code == 200
    with pytest.raises(CommandError):
        call_command("kcaas_create_tenant", "demo", stdout=io.StringIO(), stderr=io.StringIO())
    out = io.StringIO()
    call_command("kcaas_create_tenant", "demo", "--reuse", stdout=out, stderr=io.StringIO())
    assert Tenant.objects.filter(name="demo").count() == 1
    assert Tenant.objects.get(name="demo").api_keys.count() == 2


def test_make_ups_demo_key_replaces_its_predecessor_instead_of_piling_up(db):
    """make up runs the command at every start: with --replace the earlier "make up" key is revoked, so restarts
    never reach the tenant's max_api_keys quota; other keys of the tenant are left alone."""
    keys = []
    for _ in range(3):
        out = io.StringIO()
        call_command(
            "kcaas_create_tenant",
            "demo",
            "--reuse",
            "--replace",
            "--key-name",
            "make up",
            stdout=out,
            stderr=io.StringIO(),
        )
        keys.append(out.getvalue().strip())
    tenant = Tenant.objects.get(name="demo")
    other = services.api_key_issue(tenant=tenant, scopes=["keys:read"], name="mine")
    call_command(
        "kcaas_create_tenant",
        "demo",
        "--reuse",
        "--replace",
        "--key-name",
        "make up",
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    active = tenant.api_keys.filter(revoked_at__isnull=True)
    assert sorted(k.name for k in active) == ["make up", "mine"] and other.api_key in active
    assert key_client(keys[0]).get("/api/v1/keys").status_code == 401  # the first one was revoked


@pytest.mark.parametrize("name", ["", "   ", "nul\x00byte", "tab\there", "lone\ud800surrogate", "x" * 101])
def test_tenant_create_service_refuses_bad_names(db, name):
    with pytest.raises(services.ValidationFailed) as caught:
        services.tenant_create(name=name)
    assert set(caught.value.details["fields"]) == {"name"}
    assert not Tenant.objects.exists()


def test_api_key_issue_service_validates(tenant):
    from datetime import timedelta

    from django.utils import timezone

    for kwargs, field in (
        ({"scopes": []}, "scopes"),
        ({"scopes": ["keys:admin"]}, "scopes"),
        ({"scopes": ["keys:read"], "expires_at": timezone.now() - timedelta(seconds=1)}, "expires_at"),
    ):
        with pytest.raises(services.ValidationFailed) as caught:
            services.api_key_issue(tenant=tenant, **kwargs)
        assert set(caught.value.details["fields"]) == {field}
    Tenant.objects.filter(pk=tenant.pk).update(status="erased")
    tenant.refresh_from_db()
    with pytest.raises(services.ConflictError):
        services.api_key_issue(tenant=tenant, scopes=["keys:read"])
