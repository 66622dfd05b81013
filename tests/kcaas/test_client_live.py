"""kcaas.Client end to end against the live control plane (real socket, PostgreSQL, Redis, Celery workers)."""

import threading
import time
import uuid
from datetime import UTC, datetime

import pytest

import kcaas
from caches.models import Cache, DataToken, IdempotencyRecord
from kcaas import errors
from kcaas.spec import KVCacheSpec
from tenants import services as tenant_services
from tenants.models import ApiKey
from tests.caches.conftest import BLOCK_BYTES, SPEC

pytestmark = pytest.mark.django_db(transaction=True)

CAPACITY = {"device": 64 * BLOCK_BYTES}
ALL_WRITE = ("caches:write", "keys:write")


def _no_key(exc: BaseException, raw_key: str) -> None:
    secret = raw_key.rsplit("_", 1)[-1]
    for text in (str(exc), repr(exc), str(exc.details), str(exc.args)):
        assert raw_key not in text and secret not in text


def test_attach_waits_ready_then_list_get_token_detach(make_tenant, node, sdk):
    tenant = make_tenant(scopes=ALL_WRITE)
    client = sdk(tenant.raw_key)

    me = client.whoami()
    assert me.kind == "tenant_key" and me.tenant_id == str(tenant.tenant.pk) and "caches:write" in me.scopes

    cache = client.attach("chat", KVCacheSpec(**SPEC), CAPACITY, timeout=20)
    assert cache.is_ready and cache.endpoint == node.endpoint and cache.node_id == str(node.pk)
    assert cache.spec == KVCacheSpec(**SPEC) and cache.block_bytes == BLOCK_BYTES
    assert cache.capacity == {"device": 64 * BLOCK_BYTES, "dram": 0, "ssd": 0, "network": 0} and cache.epoch == 1

    assert [c.id for c in client.list_caches()] == [cache.id]
    assert client.get_cache(cache.id) == cache

    token = client.issue_token(cache.id, access="read", ttl_seconds=120)
    assert token.cache_id == cache.id and token.access == "read" and token.endpoint == node.endpoint
    assert token.expires_at > datetime.now(UTC)
    assert token.claims()["aud"] == f"cache:{cache.id}" and token.token not in repr(token)

    detaching = client.detach(cache.id)
    assert detaching.state == "detaching"
    assert client.detach(cache.id, wait=True, timeout=20).state == "detached"
    assert client.list_caches(state="ready") == []


def test_attach_accepts_a_dict_spec_and_list_follows_pagination(make_tenant, node, sdk):
    client = sdk(make_tenant().raw_key)
    made = {client.attach(f"c{i}", dict(SPEC), CAPACITY, wait=False).id for i in range(3)}
    client.page_size = 2  # three caches over two pages
    assert {c.id for c in client.list_caches()} == made


def test_failed_provisioning_raises_with_the_nodes_reason(make_tenant, node, workers, sdk):
    workers.fail_reason = "not enough device memory"
    client = sdk(make_tenant().raw_key)
    with pytest.raises(errors.CacheFailedError, match="not enough device memory") as caught:
        client.attach("doomed", SPEC, CAPACITY, timeout=20)
    assert caught.value.cache.state == "failed"
    assert caught.value.details["failure_reason"] == "not enough device memory"
    assert client.detach(caught.value.cache.id).state == "detached"  # a failed cache detaches at once


def test_attach_times_out_as_a_timeout_error(make_tenant, node, sdk):
    client = sdk(make_tenant().raw_key)
    with pytest.raises(TimeoutError) as caught:
        client.attach("slow", SPEC, CAPACITY, timeout=0)
    assert isinstance(caught.value, errors.WaitTimeoutError) and caught.value.cache.state == "provisioning"


def test_keys_create_list_rotate_revoke(make_tenant, node, sdk):
    tenant = make_tenant(scopes=ALL_WRITE)
    admin = sdk(tenant.raw_key)

    issued = admin.create_key(["caches:read"], name="reader", expires_in_seconds=3600)
    assert issued.key.startswith(f"kc_live_{issued.public_id}_") and issued.key not in repr(issued)
    assert issued.scopes == ("caches:read",) and issued.state == "active" and issued.expires_at is not None
    reader = sdk(issued.key)
    assert reader.whoami().key_id == issued.id
    assert issued.id in {k.id for k in admin.list_keys()}

    rotated = admin.rotate_key(issued.id, overlap_seconds=0)
    assert rotated.rotated_from == issued.id and rotated.scopes == ("caches:read",)
    assert sdk(rotated.key).whoami().key_id == rotated.id

    revoked = admin.revoke_key(rotated.id)
    assert revoked.state == "revoked" and revoked.revoked_at is not None
    with pytest.raises(errors.AuthenticationError) as caught:
        sdk(rotated.key).whoami()
    assert caught.value.status == 401 and caught.value.code == "api_key_revoked"
    _no_key(caught.value, rotated.key)


def test_typed_errors_carry_status_code_and_details(make_tenant, node, sdk):
    tenant = make_tenant(scopes=("caches:write",), max_caches=1)
    client = sdk(tenant.raw_key, retries=0)

    with pytest.raises(errors.NotFoundError) as caught:
        client.get_cache(str(uuid.uuid4()))
    assert (caught.value.status, caught.value.code) == (404, "not_found")

    with pytest.raises(errors.ValidationError) as caught:
        client.attach("bad", {**SPEC, "num_layers": 0}, CAPACITY)
    assert (caught.value.status, caught.value.code) == (400, "invalid_spec") and "fields" in caught.value.details

    cache = client.attach("one", SPEC, CAPACITY, wait=False, idempotency_key="same-key")
    with pytest.raises(errors.ValidationError) as caught:  # the same key with another body
        client.attach("two", SPEC, CAPACITY, wait=False, idempotency_key="same-key")
    assert (caught.value.status, caught.value.code) == (422, "idempotency_key_reused")

    with pytest.raises(errors.ConflictError) as caught:
        client.attach("one", SPEC, CAPACITY, wait=False)
    assert caught.value.status == 409

    with pytest.raises(errors.QuotaExceededError) as caught:
        client.attach("two", SPEC, CAPACITY, wait=False)
    assert (caught.value.status, caught.value.code) == (403, "quota_exceeded") and caught.value.details["limit"]

    with pytest.raises(errors.PermissionDeniedError) as caught:  # this key cannot mint keys
        client.create_key(["caches:read"])
    assert (caught.value.status, caught.value.code) == (403, "permission_denied")

    client.detach(cache.id, wait=True, timeout=20)
    with pytest.raises(errors.ServiceUnavailableError) as caught:  # 12 GiB fits the quota, not the 8 GiB node
        client.attach("huge", SPEC, {"device": 12 * 2**30}, wait=False)
    assert (caught.value.status, caught.value.code) == (503, "no_capacity")
    _no_key(caught.value, tenant.raw_key)


def test_a_bad_key_is_an_authentication_error_that_never_shows_the_key(live_server, sdk):
    raw = "kc_live_AAAAAAAAAAAAAAAA_" + "s" * 43 + "CRC123"
    client = sdk(raw, retries=0)
    with pytest.raises(errors.AuthenticationError) as caught:
        client.whoami()
    assert caught.value.status == 401 and caught.value.code in ("malformed_api_key", "invalid_api_key")
    _no_key(caught.value, raw)
    assert raw not in repr(client) and "s" * 43 not in repr(client)


def test_rate_limited_requests_wait_for_retry_after_and_succeed(make_tenant, sdk):
    tenant = make_tenant()
    tenant_services.quota_update(tenant=tenant.tenant, max_requests_per_second=1)
    client = sdk(tenant.raw_key)
    slept = []
    real_sleep = client._sleep
    client._sleep = lambda s: (slept.append(s), real_sleep(s))

    started = time.monotonic()
    for _ in range(2):  # burst 1: the second waits
        assert client.whoami().kind == "tenant_key"
    assert slept and all(1.0 <= s <= 1.2 for s in slept)  # Retry-After: 1 (+ jitter), not the 0.2 s backoff
    assert time.monotonic() - started >= 1.0

    impatient = sdk(tenant.raw_key, retries=0)
    with pytest.raises(errors.RateLimitedError) as caught:
        impatient.whoami()
        impatient.whoami()
    assert (caught.value.status, caught.value.code) == (429, "rate_limited") and caught.value.retry_after >= 1


def test_a_lost_attach_response_is_retried_with_the_same_idempotency_key(make_tenant, node, sdk):
    tenant = make_tenant()
    client = sdk(tenant.raw_key)
    sent = []
    real_send = client._send_once

    def lose_first_post_answer(method, target, body, headers):
        response = real_send(method, target, body, headers)  # the server did the work...
        if method == "POST":
            sent.append(headers["Idempotency-Key"])
            if len(sent) == 1:
                client.close()
                raise ConnectionResetError("connection reset by peer")  # ...and the answer was lost
        return response

    client._send_once = lose_first_post_answer
    cache = client.attach("once", SPEC, CAPACITY, timeout=20)
    assert cache.is_ready and len(sent) == 2 and sent[0] == sent[1]
    assert IdempotencyRecord.objects.filter(tenant=tenant.tenant).count() == 1
    assert list(Cache.objects.filter(tenant=tenant.tenant).values_list("id", flat=True)) == [uuid.UUID(cache.id)]


def test_a_lost_answer_to_a_non_idempotent_post_is_not_repeated(make_tenant, sdk):
    tenant = make_tenant(scopes=ALL_WRITE)
    client = sdk(tenant.raw_key)
    real_send = client._send_once
    calls = []

    def lose_post_answers(method, target, body, headers):
        response = real_send(method, target, body, headers)
        if method == "POST":
            calls.append(target)
            raise ConnectionResetError("reset")
        return response

    client._send_once = lose_post_answers
    with pytest.raises(errors.APIConnectionError, match="not retried"):
        client.create_key(["caches:read"])
    assert len(calls) == 1 and ApiKey.objects.filter(tenant=tenant.tenant).count() == 2  # the fixture's + one


def test_connection_refused_is_retried_then_raised(sdk):
    raw = "kc_live_BBBBBBBBBBBBBBBB_" + "t" * 43 + "CRC123"
    client = kcaas.Client("http://127.0.0.1:9", raw, retries=2)
    slept = []
    client._sleep = slept.append
    with pytest.raises(errors.APIConnectionError) as caught:
        client.whoami()
    assert len(slept) == 2 and caught.value.status is None
    _no_key(caught.value, raw)


def test_requests_reuse_one_keep_alive_connection(make_tenant, sdk):
    client = sdk(make_tenant().raw_key)
    client.whoami()
    sock = client._local.conn.sock
    for _ in range(3):
        client.whoami()
        assert client._local.conn.sock is sock
    client.close()
    assert client.whoami().kind == "tenant_key"  # and reconnects after close


def test_token_source_shares_one_token_and_refreshes_ahead_of_expiry(make_tenant, node, sdk):
    tenant = make_tenant()
    client = sdk(tenant.raw_key)
    cache = client.attach("tok", SPEC, CAPACITY, timeout=20)
    source = kcaas.TokenSource(client, cache.id, access="read", ttl_seconds=120)

    got, barrier = [], threading.Barrier(8)

    def worker():
        barrier.wait()
        got.append(source.get())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({t.jti for t in got}) == 1 and DataToken.objects.filter(cache_id=cache.id).count() == 1

    first = got[0]
    lifetime = first.claims()["exp"] - first.claims()["iat"]
    now = time.monotonic()
    source._clock = lambda: now + lifetime * 0.5  # half-way: still the same token
    assert source.get().jti == first.jti
    source._clock = lambda: now + lifetime * 0.85  # inside the refresh margin (last 20%): a new one
    second = source.get()
    assert second.jti != first.jti and DataToken.objects.filter(cache_id=cache.id).count() == 2
    source.invalidate()
    assert source.get().jti != second.jti
