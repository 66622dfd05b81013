"""Idempotency-Key on POST /api/v1/caches: replay, 422 on another body, 409 while in flight, per tenant, expiry."""

import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from caches.models import Cache, CacheState, IdempotencyRecord
from tenants.models import Tenant
from tests.caches.conftest import attach_body, make_ready, purge_node_queue, run_in_thread

URL = "/api/v1/caches"


def _post(client, body, key):
    return client.post(URL, body, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.django_db
def test_same_key_same_body_replays_the_stored_response(tenant_a, node):
    first = _post(tenant_a.client, attach_body(), "k-1")
    assert first.status_code == 201 and "Idempotent-Replayed" not in first
    make_ready(first.json()["id"])  # the cache moves on; the replay still shows the original response
    # Same body with keys in another order: the same request.
    body = attach_body()
    reordered = {"capacity": body["capacity"], "spec": dict(reversed(body["spec"].items())), "name": body["name"]}
    for replay in (_post(tenant_a.client, attach_body(), "k-1"), _post(tenant_a.client, reordered, "k-1")):
        assert replay.status_code == 201
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.json() == first.json()
    assert Cache.objects.count() == 1


@pytest.mark.django_db
def test_same_key_other_body_is_422(tenant_a, node):
    assert _post(tenant_a.client, attach_body(name="a"), "k-2").status_code == 201
    reused = _post(tenant_a.client, attach_body(name="b"), "k-2")
    assert reused.status_code == 422
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert Cache.objects.count() == 1


@pytest.mark.django_db
def test_keys_are_scoped_per_tenant(tenant_a, tenant_b, node):
    a = _post(tenant_a.client, attach_body(), "shared-key")
    b = _post(tenant_b.client, attach_body(), "shared-key")
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]
    assert "Idempotent-Replayed" not in b


@pytest.mark.django_db
def test_a_refused_request_frees_its_key(make_tenant, node):
    tenant = make_tenant(max_caches=0)
    refused = _post(tenant.client, attach_body(), "k-3")
    assert refused.status_code == 403 and not IdempotencyRecord.objects.exists()
    from tenants import services as tenant_services

    tenant_services.quota_update(tenant=tenant.tenant, max_caches=1)
    assert _post(tenant.client, attach_body(), "k-3").status_code == 201
    invalid = _post(tenant.client, attach_body(kv_dtype="nope"), "k-4")
    assert invalid.status_code == 400 and not IdempotencyRecord.objects.filter(key="k-4").exists()


@pytest.mark.django_db
def test_expired_keys_are_new_keys(tenant_a, node):
    assert _post(tenant_a.client, attach_body(name="a"), "k-5").status_code == 201
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    again = _post(tenant_a.client, attach_body(name="b"), "k-5")
    assert again.status_code == 201 and again.json()["name"] == "b"


@pytest.mark.django_db
def test_abandoned_claims_are_taken_over(tenant_a, node):
    # A holder that died before committing leaves an in_progress record and no cache.
    long_ago = timezone.now() - timedelta(minutes=5)
    IdempotencyRecord.objects.create(
        tenant=tenant_a.tenant,
        key="k-6",
        fingerprint="0" * 64,
        locked_at=long_ago,
        expires_at=timezone.now() + timedelta(hours=1),
    )
    assert _post(tenant_a.client, attach_body(), "k-6").status_code == 422  # still another request's key
    IdempotencyRecord.objects.filter(key="k-6").delete()
    IdempotencyRecord.objects.create(
        tenant=tenant_a.tenant, key="k-6", fingerprint="0" * 64, locked_at=long_ago, expires_at=long_ago
    )
    assert _post(tenant_a.client, attach_body(), "k-6").status_code == 201


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "tab\tkey"])
def test_malformed_keys_are_400(tenant_a, node, key):
    response = _post(tenant_a.client, attach_body(), key)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_idempotency_key"


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicate_is_409_while_the_first_is_in_flight(tenant_a, node):
    try:
        with transaction.atomic():
            # Hold the tenant row: the first request claims its key, then waits in tenant_lock, in flight. (NO KEY
            # UPDATE still conflicts with tenant_lock's FOR UPDATE but lets the claim's foreign-key check through.)
            Tenant.objects.select_for_update(no_key=True).get(pk=tenant_a.tenant.pk)
            first = run_in_thread(_post, tenant_a.client, attach_body(), "k-7")
            deadline = time.monotonic() + 10
            while not IdempotencyRecord.objects.filter(key="k-7").exists():
                assert time.monotonic() < deadline, "the first request never claimed its key"
                time.sleep(0.01)
            duplicate = run_in_thread(_post, tenant_a.client, attach_body(), "k-7")
            other_body = run_in_thread(_post, tenant_a.client, attach_body(name="zz"), "k-7")
            duplicate.join(10)
            other_body.join(10)
            assert first.is_alive()  # still waiting for the lock
        first.join(10)
        assert duplicate.result.status_code == 409
        assert duplicate.result.json()["error"]["code"] == "idempotency_in_progress"
        assert other_body.result.status_code == 422
        assert first.result.status_code == 201, first.result.content
        replay = _post(tenant_a.client, attach_body(), "k-7")
        assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
        assert replay.json() == first.result.json()
        assert Cache.objects.exclude(state=CacheState.DETACHED).count() == 1
    finally:
        purge_node_queue(node.pk)
