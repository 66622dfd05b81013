"""Rotation with an overlap window: the old key works inside it and is refused after; one successor per key."""

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from core.errors import ApplicationError
from tenants import authentication, services
from tenants.models import ApiKey

from .conftest import assert_error, key_client, run_concurrently

KEYS_URL = "/api/v1/keys"


def _at(moment):
    """Run authentication as if the clock read ``moment``."""
    return mock.patch.object(authentication.timezone, "now", return_value=moment)


def test_old_key_works_inside_the_overlap_and_is_refused_after(tenant_client, issued_key):
    old_id = issued_key.api_key.pk
    before = timezone.now()
    response = tenant_client.post(f"{KEYS_URL}/{old_id}/rotate", {"overlap_seconds": 600}, format="json")
    assert response.status_code == 201
    new = response.json()
    assert new["rotated_from"] == str(old_id) and new["key"] != issued_key.raw_key
    assert new["scopes"] == issued_key.api_key.scopes
    new_client = key_client(new["key"])

    old = ApiKey.objects.get(pk=old_id)
    assert before + timedelta(seconds=600) <= old.expires_at <= timezone.now() + timedelta(seconds=600)

    assert tenant_client.get(KEYS_URL).status_code == 200  # inside the window: both work
    assert new_client.get(KEYS_URL).status_code == 200
    with _at(old.expires_at - timedelta(seconds=1)):
        assert tenant_client.get(KEYS_URL).status_code == 200
    with _at(old.expires_at + timedelta(seconds=1)):
        assert_error(tenant_client.get(KEYS_URL), 401, "api_key_expired")
        assert new_client.get(KEYS_URL).status_code == 200


def test_zero_overlap_cuts_the_old_key_off_at_once(tenant_client, issued_key):
    response = tenant_client.post(f"{KEYS_URL}/{issued_key.api_key.pk}/rotate", {"overlap_seconds": 0}, format="json")
    assert response.status_code == 201
    assert_error(tenant_client.get(KEYS_URL), 401, "api_key_expired")
    assert key_client(response.json()["key"]).get(KEYS_URL).status_code == 200


def test_default_overlap_is_an_hour(tenant_client, issued_key):
    tenant_client.post(f"{KEYS_URL}/{issued_key.api_key.pk}/rotate", format="json")
    old = ApiKey.objects.get(pk=issued_key.api_key.pk)
    assert abs((old.expires_at - timezone.now()) - timedelta(hours=1)) < timedelta(seconds=30)


def test_rotation_keeps_an_earlier_expiry_and_carries_it_over(tenant, make_key):
    expires = timezone.now() + timedelta(minutes=5)
    issued = make_key(tenant, scopes=["caches:read"], name="worker", expires_at=expires)
    successor = services.api_key_rotate(api_key=issued.api_key, overlap_seconds=3600).api_key
    old = ApiKey.objects.get(pk=issued.api_key.pk)
    assert old.expires_at == expires  # the overlap never extends a key's life
    assert successor.expires_at == expires and successor.name == "worker" and successor.scopes == ["caches:read"]


@pytest.mark.parametrize("overlap", [-1, 7 * 24 * 3600 + 1, "soon", 1.5, None])
def test_overlap_validation(tenant_client, issued_key, overlap):
    url = f"{KEYS_URL}/{issued_key.api_key.pk}/rotate"
    response = tenant_client.post(url, {"overlap_seconds": overlap}, format="json")
    error = assert_error(response, 400, "validation_error")
    assert "overlap_seconds" in error["details"]["fields"]
    with pytest.raises(ApplicationError):
        services.api_key_rotate(api_key=issued_key.api_key, overlap_seconds=overlap)
    assert not ApiKey.objects.filter(rotated_from=issued_key.api_key).exists()


def test_a_key_rotates_once(tenant, make_key, tenant_client):
    target = make_key(tenant, scopes=["keys:read"])
    url = f"{KEYS_URL}/{target.api_key.pk}/rotate"
    assert tenant_client.post(url, {"overlap_seconds": 60}, format="json").status_code == 201
    assert_error(tenant_client.post(url, {"overlap_seconds": 60}, format="json"), 409, "api_key_already_rotated")


def test_revoked_or_expired_keys_do_not_rotate(tenant, make_key, tenant_client):
    revoked = make_key(tenant, scopes=["keys:read"])
    services.api_key_revoke(api_key=revoked.api_key)
    expired = make_key(tenant, scopes=["keys:read"])
    ApiKey.objects.filter(pk=expired.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    for target in (revoked, expired):
        response = tenant_client.post(f"{KEYS_URL}/{target.api_key.pk}/rotate", {}, format="json")
        assert_error(response, 409, "api_key_inactive")


def test_revocation_is_irreversible_and_idempotent(tenant_client, tenant, make_key):
    target = make_key(tenant, scopes=["keys:read"])
    url = f"{KEYS_URL}/{target.api_key.pk}/revoke"
    first = tenant_client.post(url).json()
    second = tenant_client.post(url).json()
    assert first["state"] == "revoked" and first["revoked_at"] == second["revoked_at"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_rotations_make_exactly_one_successor(make_tenant, make_key):
    tenant = make_tenant()
    caller = make_key(tenant).raw_key
    target = make_key(tenant, scopes=["keys:read"])
    url = f"{KEYS_URL}/{target.api_key.pk}/rotate"

    def rotate():
        return key_client(caller).post(url, {"overlap_seconds": 60}, format="json").status_code

    statuses = run_concurrently(rotate, [()] * 6)
    assert sorted(statuses) == [201] + [409] * 5
    assert ApiKey.objects.filter(rotated_from=target.api_key).count() == 1
