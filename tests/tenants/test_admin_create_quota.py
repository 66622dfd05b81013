"""POST /api/v1/admin/tenants with initial quota overrides: set in the tenant's own transaction, so a refused value
creates nothing (the `kcaas admin tenants create NAME --device-bytes 8GiB` path)."""

import pytest

from tenants import selectors
from tenants.models import Tenant

from .conftest import assert_error

TENANTS_URL = "/api/v1/admin/tenants"


def test_a_tenant_is_created_with_its_quota_overrides(staff_client):
    body = {"name": "globex", "quota": {"max_device_bytes": "8GiB", "max_caches": 3}}
    created = staff_client.post(TENANTS_URL, body, format="json")
    assert created.status_code == 201, created.content
    assert set(created.json()) == {"id", "name", "status", "created_at"}
    quota = staff_client.get(f"{TENANTS_URL}/{created.json()['id']}/quota").json()
    assert quota["max_device_bytes"] == 8 << 30 and quota["max_caches"] == 3
    assert quota["overrides"]["max_device_bytes"] == 8 << 30 and quota["overrides"]["max_dram_bytes"] is None


@pytest.mark.parametrize(
    "quota, field",
    [
        ({"max_device_bytes": "lots"}, "max_device_bytes"),
        ({"max_caches": -1}, "max_caches"),
        ({"max_requests_per_second": 0}, "max_requests_per_second"),
        ({"max_gpus": 1}, "max_gpus"),
    ],
)
def test_a_refused_quota_value_creates_nothing(staff_client, db, quota, field):
    error = assert_error(
        staff_client.post(TENANTS_URL, {"name": "initech", "quota": quota}, format="json"), 400, "validation_error"
    )
    assert field in error["details"]["fields"]["quota"]
    assert not Tenant.objects.filter(name="initech").exists()


def test_without_quota_the_defaults_hold(staff_client):
    created = staff_client.post(TENANTS_URL, {"name": "hooli"}, format="json").json()
    overrides = selectors.quota_overrides(tenant=Tenant.objects.get(pk=created["id"]))
    assert overrides and set(overrides.values()) == {None}
