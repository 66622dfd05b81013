"""POST /api/v1/caches/{id}/tokens: claims, offline verification with the JWKS key, scopes, quota."""

import time
import uuid
from unittest import mock

import jwt
import pytest
from django.test import override_settings

from caches.models import Cache, DataToken
from tests.caches.conftest import attach_body, make_ready

pytestmark = pytest.mark.django_db


def _attach_ready(handle, name="c1") -> Cache:
    response = handle.client.post("/api/v1/caches", attach_body(name=name), format="json")
    assert response.status_code == 201, response.content
    return make_ready(response.json()["id"])


def _issue(client, cache_id, **body):
    return client.post(f"/api/v1/caches/{cache_id}/tokens", body, format="json")


def _public_key(client):
    (jwk,) = client.get("/.well-known/jwks.json").json()["keys"]
    return jwt.PyJWK(jwk).key


def _verify(token, key, cache_id, **options):
    return jwt.decode(
        token,
        key,
        algorithms=["EdDSA"],
        audience=f"cache:{cache_id}",
        issuer="kcaas-control-plane",
        options={"require": ["exp", "iat", "nbf", "aud", "iss", "sub", "jti"]},
        **options,
    )


def test_token_claims_verify_offline_with_the_jwks_key(tenant_a, node, client):
    cache = _attach_ready(tenant_a)
    before = int(time.time())
    response = _issue(tenant_a.client, cache.pk, access="readwrite")
    assert response.status_code == 201, response.content
    body = response.json()
    claims = _verify(body["token"], _public_key(client), cache.pk)
    assert claims["sub"] == f"tenant:{tenant_a.tenant.pk}"
    assert claims["aud"] == f"cache:{cache.pk}"
    assert claims["epoch"] == 1 and claims["node"] == str(node.pk) and claims["access"] == "readwrite"
    assert claims["scope"] == "kv:read kv:write"
    assert claims["jti"] == body["jti"]
    assert before <= claims["iat"] == claims["nbf"] <= int(time.time())
    assert claims["exp"] - claims["iat"] == 15 * 60
    assert body["cache_id"] == str(cache.pk) and body["endpoint"] == cache.endpoint and body["node_id"] == str(node.pk)
    token_row = DataToken.objects.get(pk=body["jti"])
    assert token_row.tenant_id == tenant_a.tenant.pk and int(token_row.expires_at.timestamp()) == claims["exp"]


def test_wrong_audience_expired_and_tampered_tokens_are_rejected(tenant_a, node, client):
    cache, other = _attach_ready(tenant_a, "c1"), _attach_ready(tenant_a, "c2")
    key = _public_key(client)
    token = _issue(tenant_a.client, cache.pk).json()["token"]
    with pytest.raises(jwt.InvalidAudienceError):
        _verify(token, key, other.pk)  # a token for one cache does not open another
    header, payload, signature = token.split(".")
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    with pytest.raises(jwt.InvalidSignatureError):
        _verify(f"{header}.{payload}.{flipped}", key, cache.pk)
    forged_payload = jwt.utils.base64url_encode(
        jwt.utils.base64url_decode(payload).replace(str(cache.pk).encode(), str(other.pk).encode())
    ).decode()
    with pytest.raises(jwt.InvalidSignatureError):
        _verify(f"{header}.{forged_payload}.{signature}", key, other.pk)
    with pytest.raises(jwt.InvalidAlgorithmError):
        jwt.decode(jwt.encode({"aud": f"cache:{cache.pk}"}, "s" * 32, algorithm="HS256"), key, algorithms=["EdDSA"])
    with mock.patch("caches.services.time.time", return_value=time.time() - 120):  # issued two minutes ago
        short = _issue(tenant_a.client, cache.pk, ttl_seconds=1).json()["token"]  # clamped up to 60 s
    claims = jwt.decode(short, key, algorithms=["EdDSA"], options={"verify_exp": False}, audience=f"cache:{cache.pk}")
    assert claims["exp"] - claims["iat"] == 60
    with pytest.raises(jwt.ExpiredSignatureError):
        _verify(short, key, cache.pk)


def test_ttl_is_clamped_to_the_configured_maximum(tenant_a, node, client):
    cache = _attach_ready(tenant_a)
    with override_settings(KCAAS_DATA_TOKEN_TTL_SECONDS=300):
        for asked, granted in ((10**6, 300), (120, 120), (None, 300)):
            body = {} if asked is None else {"ttl_seconds": asked}
            token = _issue(tenant_a.client, cache.pk, **body).json()["token"]
            claims = jwt.decode(token, options={"verify_signature": False})
            assert claims["exp"] - claims["iat"] == granted


def test_access_levels_need_the_matching_scope(tenant_a, node):
    cache = _attach_ready(tenant_a)
    reader = tenant_a.key("caches:read")
    response = _issue(reader, cache.pk, access="read")
    assert response.status_code == 201
    assert jwt.decode(response.json()["token"], options={"verify_signature": False})["access"] == "read"
    refused = _issue(reader, cache.pk, access="readwrite")
    assert refused.status_code == 403 and refused.json()["error"]["details"]["required_scope"] == "caches:write"
    keys_only = _issue(tenant_a.key("keys:write"), cache.pk)
    assert keys_only.status_code == 403 and keys_only.json()["error"]["details"]["required_scope"] == "caches:read"
    assert _issue(tenant_a.client, cache.pk, access="admin").status_code == 400


def test_staff_and_anonymous_callers_get_no_tokens(tenant_a, node, staff_client, client):
    cache = _attach_ready(tenant_a)
    assert _issue(staff_client, cache.pk).status_code == 403
    assert _issue(client, cache.pk).status_code == 401


def test_cache_not_ready_is_409(tenant_a, node):
    response = tenant_a.client.post("/api/v1/caches", attach_body(), format="json")
    refused = _issue(tenant_a.client, response.json()["id"])
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "cache_not_ready"
    assert refused.json()["error"]["details"] == {"state": "provisioning"}


def test_another_tenants_cache_is_404(tenant_a, tenant_b, node):
    cache = _attach_ready(tenant_a)
    for cache_id in (cache.pk, uuid.uuid4()):
        refused = _issue(tenant_b.client, cache_id)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    assert not DataToken.objects.filter(tenant=tenant_b.tenant).exists()


def test_outstanding_tokens_are_limited_per_tenant(make_tenant, node):
    tenant = make_tenant(max_data_tokens_outstanding=3)
    first, second = _attach_ready(tenant, "c1"), _attach_ready(tenant, "c2")
    jtis = [_issue(tenant.client, cache.pk).json()["jti"] for cache in (first, second, first)]
    refused = _issue(tenant.client, second.pk)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "quota_exceeded"
    assert refused.json()["error"]["details"]["limit"] == "max_data_tokens_outstanding"
    # Expired and revoked tokens no longer count.
    DataToken.objects.filter(pk=jtis[0]).update(expires_at="2000-01-01T00:00:00Z")
    assert _issue(tenant.client, second.pk).status_code == 201
    assert _issue(tenant.client, second.pk).status_code == 403
    tenant.client.delete(f"/api/v1/caches/{first.pk}")  # detach revokes the cache's tokens
    assert DataToken.objects.filter(cache=first, revoked_at__isnull=False).count() == 1
    assert _issue(tenant.client, second.pk).status_code == 201
