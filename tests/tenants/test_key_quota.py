"""The per-tenant API-key limit (quota field max_api_keys): usable keys (neither revoked nor expired) are counted
under the tenant lock when a key is issued or rotated; past the limit, 403 quota_exceeded with details, as data
tokens do. And the one answer that carries a new key's secret (issue, rotation) is never stored by a cache."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import selectors, services
from tenants.models import ApiKey, Tenant

from .conftest import assert_error, key_client, run_concurrently

KEYS_URL = "/api/v1/keys"


def _quota_url(tenant) -> str:
    return f"/api/v1/admin/tenants/{tenant.pk}/quota"


def test_the_default_is_100_and_staff_set_it_through_the_quota_patch(staff_client, tenant, settings):
    assert settings.KCAAS_QUOTA_DEFAULTS["max_api_keys"] == 100
    body = staff_client.get(_quota_url(tenant)).json()
    assert body["max_api_keys"] == 100 and body["overrides"]["max_api_keys"] is None
    patched = staff_client.patch(_quota_url(tenant), {"max_api_keys": 3}, format="json").json()
    assert patched["max_api_keys"] == 3 and patched["overrides"]["max_api_keys"] == 3
    assert selectors.quota_limits(tenant=Tenant.objects.get(pk=tenant.pk)).max_api_keys == 3


# "3" is a limit (the console's parser), "3 keys" or "3GiB" is not
@pytest.mark.parametrize("value", ["3 keys", "3GiB", 3.0, -1, "100001", 100_001, True])
def test_the_limit_is_a_bounded_json_integer(staff_client, tenant, value):
    error = assert_error(
        staff_client.patch(_quota_url(tenant), {"max_api_keys": value}, format="json"), 400, "validation_error"
    )
    assert list(error["details"]["fields"]) == ["max_api_keys"]


def test_issuing_past_the_limit_is_403_quota_exceeded(make_tenant, make_key):
    tenant = make_tenant("limited", max_api_keys=2)
    first = make_key(tenant)
    make_key(tenant, scopes=["caches:read"])
    error = assert_error(
        key_client(first.raw_key).post(KEYS_URL, {"scopes": ["caches:read"]}, format="json"), 403, "quota_exceeded"
    )
    assert error["details"] == {"limit": "max_api_keys", "limit_value": 2, "in_use": 2}
    with pytest.raises(services.QuotaExceeded):
        services.api_key_issue(tenant=tenant, scopes=["caches:read"])
    assert ApiKey.objects.filter(tenant=tenant).count() == 2


def test_revoked_and_expired_keys_do_not_count(make_tenant, make_key):
    tenant = make_tenant("churn", max_api_keys=1)
    services.api_key_revoke(api_key=make_key(tenant).api_key)
    expiring = make_key(tenant, expires_at=timezone.now() + timedelta(seconds=60))
    ApiKey.objects.filter(pk=expiring.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    make_key(tenant)  # the one usable key
    with pytest.raises(services.QuotaExceeded):
        make_key(tenant)


def test_lowering_the_limit_keeps_existing_keys_and_stops_new_ones(make_tenant, make_key):
    tenant = make_tenant("lowered")
    keys = [make_key(tenant) for _ in range(3)]
    services.quota_update(tenant=tenant, max_api_keys=1)
    assert all(key_client(k.raw_key).get("/api/v1/whoami").status_code == 200 for k in keys)
    with pytest.raises(services.QuotaExceeded):
        make_key(tenant)


def test_a_key_at_the_limit_can_still_be_rotated_once_per_overlap(make_tenant, make_key):
    """Rotation replaces its key: at the limit it is allowed, taking the tenant one over for the overlap; a second
    rotation waits until the first's old key expired (or was revoked), so the count never grows past limit + 1."""
    tenant = make_tenant("rotating", max_api_keys=2)
    a, b = make_key(tenant), make_key(tenant)
    a2 = key_client(a.raw_key).post(f"{KEYS_URL}/{a.api_key.pk}/rotate", {"overlap_seconds": 3600}, format="json")
    assert a2.status_code == 201, a2.content
    refused = key_client(b.raw_key).post(f"{KEYS_URL}/{b.api_key.pk}/rotate", {"overlap_seconds": 60}, format="json")
    error = assert_error(refused, 403, "quota_exceeded")
    assert error["details"] == {"limit": "max_api_keys", "limit_value": 2, "in_use": 2}
    services.api_key_revoke(api_key=a.api_key)  # the first rotation's old key is gone: the second may go
    assert services.api_key_rotate(api_key=b.api_key, overlap_seconds=0).api_key.rotated_from_id == b.api_key.pk
    assert selectors.active_key_counts(tenant_ids=[tenant.pk])[tenant.pk] == 2


@pytest.mark.django_db(transaction=True)
def test_concurrent_issues_never_pass_the_limit(make_tenant):
    tenant = make_tenant("racing", max_api_keys=3)

    def issue(_):
        try:
            services.api_key_issue(tenant=tenant, scopes=["caches:read"])
            return "issued"
        except services.QuotaExceeded:
            return "refused"

    outcomes = run_concurrently(issue, [(i,) for i in range(8)])
    assert outcomes.count("issued") == 3 and outcomes.count("refused") == 5
    assert ApiKey.objects.filter(tenant=tenant).count() == 3


# ---- the secret's answers --------------------------------------------------------------------------------------------


def test_the_issue_answer_carrying_the_secret_is_no_store(tenant_client):
    response = tenant_client.post(KEYS_URL, {"scopes": ["caches:read"]}, format="json")
    assert response.status_code == 201 and response.json()["key"].startswith("kc_live_")
    assert response["Cache-Control"] == "no-store"


def test_the_rotation_answer_carrying_the_secret_is_no_store(tenant_client, issued_key):
    response = tenant_client.post(f"{KEYS_URL}/{issued_key.api_key.pk}/rotate", {"overlap_seconds": 0}, format="json")
    assert response.status_code == 201 and response.json()["key"].startswith("kc_live_")
    assert response["Cache-Control"] == "no-store"


def test_staff_issuing_for_a_tenant_get_no_store_too(staff_client, tenant):
    response = staff_client.post(KEYS_URL, {"scopes": ["caches:read"], "tenant_id": str(tenant.pk)}, format="json")
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
