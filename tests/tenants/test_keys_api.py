"""The keys REST API: scope enforcement on every endpoint, tenant isolation (404, never 403), secrets shown once."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from tenants.models import ApiKey

from .conftest import assert_error, key_client

KEYS_URL = "/api/v1/keys"


def _key_endpoints(key_id):
    """(method, url, body) for every keys endpoint, and the scope each needs."""
    return [
        ("get", KEYS_URL, None, "keys:read"),
        ("post", KEYS_URL, {"scopes": ["keys:read"]}, "keys:write"),
        ("get", f"{KEYS_URL}/{key_id}", None, "keys:read"),
        ("post", f"{KEYS_URL}/{key_id}/revoke", None, "keys:write"),
        ("post", f"{KEYS_URL}/{key_id}/rotate", {"overlap_seconds": 0}, "keys:write"),
    ]


def _call(client, method, url, body):
    return getattr(client, method)(url, body, format="json") if body is not None else getattr(client, method)(url)


@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize(
    "scopes, allowed",
    [
        (["caches:write", "usage:read", "audit:write"], set()),  # no keys scope at all
        (["keys:read"], {"keys:read"}),
        (["keys:write"], {"keys:read", "keys:write"}),  # write implies read
    ],
)
def test_scope_enforcement_on_every_keys_endpoint(tenant, make_key, index, scopes, allowed):
    target = make_key(tenant, scopes=["keys:read"])
    caller = make_key(tenant, scopes=scopes)
    method, url, body, needed = _key_endpoints(target.api_key.pk)[index]
    response = _call(key_client(caller.raw_key), method, url, body)
    if needed in allowed:
        assert response.status_code in (200, 201), response.content
    else:
        error = assert_error(response, 403, "permission_denied")
        assert error["details"] == {"required_scope": needed}


@pytest.mark.parametrize("index", range(5))
def test_anonymous_callers_get_401_on_every_keys_endpoint(anon_client, db, index):
    method, url, body, _ = _key_endpoints(uuid.uuid4())[index]
    assert_error(_call(anon_client, method, url, body), 401, "not_authenticated")


@pytest.mark.parametrize("index", range(5))
def test_a_plain_django_user_gets_403_on_every_keys_endpoint(user_client, index):
    method, url, body, _ = _key_endpoints(uuid.uuid4())[index]
    assert_error(_call(user_client, method, url, body), 403, "permission_denied")


def test_create_returns_the_raw_key_once_and_listing_never_shows_secrets(tenant_client, issued_key):
    response = tenant_client.post(KEYS_URL, {"name": "ci", "scopes": ["caches:read", "caches:read"]}, format="json")
    assert response.status_code == 201
    created = response.json()
    raw = created["key"]
    assert raw.startswith(f"kc_live_{created['public_id']}_")
    assert created["scopes"] == ["caches:read"] and created["name"] == "ci" and created["state"] == "active"
    stored = ApiKey.objects.get(pk=created["id"])
    secret = raw.split("_")[3][:43]
    for url in (KEYS_URL, f"{KEYS_URL}/{created['id']}"):
        text = tenant_client.get(url).content.decode()
        assert raw not in text and secret not in text and stored.secret_hash not in text
        assert '"key"' not in text and "secret" not in text
    assert secret not in str(ApiKey.objects.filter(pk=created["id"]).values().get())
    # The new key works on its own scope and nothing else.
    new_client = key_client(raw)
    assert_error(new_client.get(KEYS_URL), 403, "permission_denied")


def test_list_is_paginated_and_newest_first(tenant, make_key, tenant_client, issued_key):
    later = [make_key(tenant, scopes=["keys:read"]) for _ in range(3)]
    body = tenant_client.get(KEYS_URL, {"limit": 2}).json()
    assert body["count"] == 4
    assert [k["id"] for k in body["results"]] == [str(later[2].api_key.pk), str(later[1].api_key.pk)]
    assert body["next"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "scopes"),
        ({"scopes": []}, "scopes"),
        ({"scopes": ["caches:admin"]}, "scopes"),
        ({"scopes": "keys:read"}, "scopes"),
        ({"scopes": ["keys:read"], "name": "x" * 101}, "name"),
        ({"scopes": ["keys:read"], "name": "nul\u0000byte"}, "name"),
        ({"scopes": ["keys:read"], "expires_in_seconds": "tomorrow"}, "expires_in_seconds"),
        ({"scopes": ["keys:read"], "expires_in_seconds": 59}, "expires_in_seconds"),
        ({"scopes": ["keys:read"], "expires_in_seconds": -1}, "expires_in_seconds"),
        ({"scopes": ["keys:read"], "expires_in_seconds": 10**12}, "expires_in_seconds"),
        ({"scopes": ["keys:read"], "tenant_id": "not-a-uuid"}, "tenant_id"),
    ],
)
def test_create_validation_errors_are_400_with_field_details(tenant_client, body, field):
    error = assert_error(tenant_client.post(KEYS_URL, body, format="json"), 400, "validation_error")
    assert field in error["details"]["fields"]


def test_create_with_a_non_object_body_is_400(tenant_client):
    assert_error(tenant_client.post(KEYS_URL, [1, 2], format="json"), 400, "validation_error")
    response = tenant_client.post(KEYS_URL, "{not json", content_type="application/json")
    assert_error(response, 400, "malformed_request")


def test_create_with_a_lifetime(tenant_client):
    response = tenant_client.post(KEYS_URL, {"scopes": ["keys:read"], "expires_in_seconds": 86400}, format="json")
    assert response.status_code == 201
    expires_at = ApiKey.objects.get(pk=response.json()["id"]).expires_at
    assert abs(expires_at - (timezone.now() + timedelta(days=1))) < timedelta(seconds=30)
    never = tenant_client.post(KEYS_URL, {"scopes": ["keys:read"], "expires_in_seconds": None}, format="json")
    assert never.status_code == 201 and never.json()["expires_at"] is None


def test_a_key_cannot_mint_a_stronger_key(tenant, make_key):
    caller = key_client(make_key(tenant, scopes=["keys:write", "caches:read"]).raw_key)
    error = assert_error(
        caller.post(KEYS_URL, {"scopes": ["caches:write", "keys:read"]}, format="json"), 403, "permission_denied"
    )
    assert error["details"] == {"not_held": ["caches:write"]}
    assert caller.post(KEYS_URL, {"scopes": ["caches:read", "keys:write"]}, format="json").status_code == 201


def test_a_key_cannot_rotate_a_stronger_key(tenant, make_key):
    strong = make_key(tenant, scopes=["caches:write"])
    caller = key_client(make_key(tenant, scopes=["keys:write"]).raw_key)
    assert_error(caller.post(f"{KEYS_URL}/{strong.api_key.pk}/rotate", {}, format="json"), 403, "permission_denied")


# ---- isolation ---------------------------------------------------------------------------------------------------


@pytest.fixture
def two_tenants(make_tenant, make_key):
    a, b = make_tenant("tenant-a"), make_tenant("tenant-b")
    return make_key(a), make_key(b)


def test_tenant_a_lists_only_its_own_keys(two_tenants):
    key_a, key_b = two_tenants
    ids = [k["id"] for k in key_client(key_a.raw_key).get(KEYS_URL).json()["results"]]
    assert ids == [str(key_a.api_key.pk)]


@pytest.mark.parametrize("action", ["get", "revoke", "rotate"])
def test_tenant_a_cannot_touch_tenant_bs_key_and_learns_nothing(two_tenants, action):
    key_a, key_b = two_tenants
    client = key_client(key_a.raw_key)

    def attempt(key_id):
        if action == "get":
            return client.get(f"{KEYS_URL}/{key_id}")
        return client.post(f"{KEYS_URL}/{key_id}/{action}", {}, format="json")

    real = assert_error(attempt(key_b.api_key.pk), 404, "not_found")
    guessed = assert_error(attempt(uuid.uuid4()), 404, "not_found")
    assert real == guessed  # an existing foreign key and a random id look the same
    key_b.api_key.refresh_from_db()
    assert key_b.api_key.revoked_at is None and key_b.api_key.expires_at is None
    assert not ApiKey.objects.filter(rotated_from=key_b.api_key).exists()
    assert key_client(key_b.raw_key).get(KEYS_URL).status_code == 200


def test_naming_another_tenant_is_a_404(two_tenants):
    key_a, key_b = two_tenants
    client = key_client(key_a.raw_key)
    assert_error(client.get(KEYS_URL, {"tenant_id": str(key_b.api_key.tenant_id)}), 404, "not_found")
    body = {"scopes": ["keys:read"], "tenant_id": str(key_b.api_key.tenant_id)}
    response = client.post(KEYS_URL, body, format="json")
    assert_error(response, 404, "not_found")
    assert ApiKey.objects.filter(tenant_id=key_b.api_key.tenant_id).count() == 1
    # Naming its own tenant is fine.
    assert client.get(KEYS_URL, {"tenant_id": str(key_a.api_key.tenant_id)}).status_code == 200


def test_malformed_key_ids_in_the_path_are_404(tenant_client):
    assert_error(tenant_client.get(f"{KEYS_URL}/not-a-uuid"), 404, "not_found")
    assert_error(tenant_client.post(f"{KEYS_URL}/123/revoke"), 404, "not_found")


# ---- staff -------------------------------------------------------------------------------------------------------


def test_staff_must_name_the_tenant(staff_client):
    assert_error(staff_client.get(KEYS_URL), 400, "tenant_required")
    assert_error(staff_client.post(KEYS_URL, {"scopes": ["keys:read"]}, format="json"), 400, "tenant_required")
    assert_error(staff_client.get(KEYS_URL, {"tenant_id": str(uuid.uuid4())}), 404, "not_found")


def test_staff_manage_any_tenants_keys(staff_client, two_tenants):
    key_a, key_b = two_tenants
    tenant_b = str(key_b.api_key.tenant_id)
    listed = staff_client.get(KEYS_URL, {"tenant_id": tenant_b}).json()["results"]
    assert [k["id"] for k in listed] == [str(key_b.api_key.pk)]
    created = staff_client.post(KEYS_URL, {"scopes": ["caches:write"], "tenant_id": tenant_b}, format="json")
    assert created.status_code == 201 and created.json()["tenant_id"] == tenant_b
    assert staff_client.get(f"{KEYS_URL}/{key_a.api_key.pk}").status_code == 200
    revoked = staff_client.post(f"{KEYS_URL}/{key_a.api_key.pk}/revoke")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
    assert_error(key_client(key_a.raw_key).get(KEYS_URL), 401, "api_key_revoked")


@pytest.mark.parametrize(
    "query, name",
    [
        ({"limit": "abc"}, "limit"),
        ({"limit": "0"}, "limit"),
        ({"limit": "501"}, "limit"),
        ({"offset": "-1"}, "offset"),
        ({"offset": str(2**63)}, "offset"),
        ({"offset": "1e3"}, "offset"),
        ({"offset": ["1", "2"]}, "offset"),
    ],
)
def test_bad_pagination_parameters_are_400(tenant_client, query, name):
    error = assert_error(tenant_client.get(KEYS_URL, query), 400, "validation_error")
    assert name in error["details"]["fields"]


def test_an_offset_past_the_end_is_an_empty_page(tenant_client):
    body = tenant_client.get(KEYS_URL, {"offset": str(10**12), "limit": "500"}).json()
    assert body["count"] == 1 and body["results"] == []
