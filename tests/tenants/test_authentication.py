"""ApiKeyAuthentication over real requests: every refusal is a 401 in the one error shape, with its own code, and
an unknown public id is indistinguishable from a wrong secret."""

import hmac
from datetime import timedelta

import pytest
from django.utils import timezone

from core import keys
from tenants import services
from tenants.models import ApiKey, Tenant
from tenants.usage import LIVE_COUNT, LIVE_LAST

from .conftest import assert_error, key_client

KEYS_URL = "/api/v1/keys"


def _with_valid_crc(body: str) -> str:
    return body + keys.checksum(body)


def test_a_valid_key_authenticates(tenant_client, issued_key):
    response = tenant_client.get(KEYS_URL)
    assert response.status_code == 200
    assert [k["id"] for k in response.json()["results"]] == [str(issued_key.api_key.pk)]


def test_authentication_costs_one_query_and_no_write(tenant_client, issued_key, django_assert_num_queries):
    url = f"{KEYS_URL}/{issued_key.api_key.pk}"
    with django_assert_num_queries(2):  # the key (with tenant and quota), then the selector
        assert tenant_client.get(url).status_code == 200


def test_no_credentials_is_401_not_authenticated(anon_client, db):
    error = assert_error(anon_client.get(KEYS_URL), 401, "not_authenticated")
    assert error["details"] == {}


def test_no_credentials_carries_www_authenticate(anon_client, db):
    response = anon_client.get(KEYS_URL)
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_refused_key_carries_www_authenticate(db):
    response = key_client("kc_live_nonsense").get(KEYS_URL)
    assert response.status_code == 401 and response["WWW-Authenticate"] == 'Bearer realm="kcaas", error="invalid_token"'


@pytest.mark.parametrize(
    "header",
    [
        "Bearer kc_live_nonsense",
        "Bearer " + "x" * 5000,
        "Bearer",
        "Bearer a b",
        "bearer kc_live_AAAAAAAAAAAAAAAA_" + "B" * 49,  # right shape, wrong checksum
    ],
)
def test_malformed_keys_are_refused_before_any_lookup(db, header, django_assert_num_queries):
    client = key_client("")
    client.credentials(HTTP_AUTHORIZATION=header)
    with django_assert_num_queries(0):
        assert_error(client.get(KEYS_URL), 401, "malformed_api_key")


def test_a_flipped_character_is_malformed(issued_key):
    raw = issued_key.raw_key
    flipped = raw[:20] + ("A" if raw[20] != "A" else "B") + raw[21:]
    assert_error(key_client(flipped).get(KEYS_URL), 401, "malformed_api_key")


def test_non_ascii_bearer_token_is_malformed(db):
    client = key_client("")
    client.credentials(HTTP_AUTHORIZATION="Bearer kc_live_\u00e9t\u00e9".encode().decode("latin-1"))
    assert_error(client.get(KEYS_URL), 401, "malformed_api_key")


def test_unknown_id_and_wrong_secret_look_the_same(issued_key, monkeypatch):
    prefix, public_id, secret = keys.parse_key(issued_key.raw_key)
    other_secret = "Z" * 43 if secret != "Z" * 43 else "Y" * 43
    wrong_secret = _with_valid_crc(f"kc_live_{public_id}_{other_secret}")
    unknown_id = _with_valid_crc(f"kc_live_{'Q' * 16}_{secret}")

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(keys.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    first = assert_error(key_client(wrong_secret).get(KEYS_URL), 401, "invalid_api_key")
    second = assert_error(key_client(unknown_id).get(KEYS_URL), 401, "invalid_api_key")
    assert first == second
    # Both paths ran one constant-time hash comparison: against the stored hash, and against the dummy hash
    # (the other comparisons are of the 6-character checksums).
    assert [b for b in compared if len(b) == 64] == [issued_key.api_key.secret_hash, keys.DUMMY_HASH]


def test_a_revoked_key_is_refused(issued_key, tenant_client):
    services.api_key_revoke(api_key=issued_key.api_key)
    assert_error(tenant_client.get(KEYS_URL), 401, "api_key_revoked")


def test_an_expired_key_is_refused_and_works_before_expiry(tenant, make_key):
    issued = make_key(tenant, expires_at=timezone.now() + timedelta(hours=1))
    client = key_client(issued.raw_key)
    assert client.get(KEYS_URL).status_code == 200
    ApiKey.objects.filter(pk=issued.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert_error(client.get(KEYS_URL), 401, "api_key_expired")


def test_revocation_is_reported_only_to_the_holder_of_the_secret(issued_key):
    services.api_key_revoke(api_key=issued_key.api_key)
    _, public_id, _ = keys.parse_key(issued_key.raw_key)
    guess = _with_valid_crc(f"kc_live_{public_id}_{'Z' * 43}")
    assert_error(key_client(guess).get(KEYS_URL), 401, "invalid_api_key")


@pytest.mark.parametrize("status", [Tenant.Status.SUSPENDED, Tenant.Status.ERASING, Tenant.Status.ERASED])
def test_inactive_tenants_are_refused(tenant, tenant_client, status):
    Tenant.objects.filter(pk=tenant.pk).update(status=status)
    error = assert_error(tenant_client.get(KEYS_URL), 401, "tenant_inactive")
    assert error["details"] == {"status": status}


def test_a_node_credential_is_not_a_tenant_key(db):
    raw, _, _ = keys.generate_key(keys.NODE_KEY_PREFIX)
    assert_error(key_client(raw).get(KEYS_URL), 401, "not_authenticated")


def test_a_request_records_usage_in_redis_not_in_the_database(tenant_client, issued_key, redis_client):
    before = timezone.now().timestamp()
    for _ in range(3):
        assert tenant_client.get(KEYS_URL).status_code == 200
    member = str(issued_key.api_key.pk)
    assert int(redis_client.hget(LIVE_COUNT, member)) == 3
    assert redis_client.zscore(LIVE_LAST, member) >= before
    issued_key.api_key.refresh_from_db()
    assert issued_key.api_key.use_count == 0 and issued_key.api_key.last_used_at is None


def test_refused_requests_record_no_usage(issued_key, tenant_client, redis_client):
    services.api_key_revoke(api_key=issued_key.api_key)
    tenant_client.get(KEYS_URL)
    assert redis_client.hget(LIVE_COUNT, str(issued_key.api_key.pk)) is None
