"""Tenant isolation and scope enforcement on every cache endpoint."""

import uuid

import pytest

from caches.models import Cache, CacheState
from tests.caches.conftest import attach_body, make_ready

pytestmark = pytest.mark.django_db


def _attach(handle, name="c1") -> dict:
    response = handle.client.post("/api/v1/caches", attach_body(name=name), format="json")
    assert response.status_code == 201, response.content
    return response.json()


def _ids(response) -> set[str]:
    assert response.status_code == 200, response.content
    return {c["id"] for c in response.json()["results"]}


def test_list_shows_own_caches_only(tenant_a, tenant_b, node):
    mine = {_attach(tenant_a, f"a{i}")["id"] for i in range(3)}
    theirs = _attach(tenant_b, "b0")["id"]
    listed = tenant_a.client.get("/api/v1/caches")
    assert _ids(listed) == mine and listed.json()["count"] == 3
    assert _ids(tenant_b.client.get("/api/v1/caches")) == {theirs}
    # Naming the other tenant does not widen the view: 404, as for any tenant that is not the caller's.
    forged = tenant_a.client.get(f"/api/v1/caches?tenant_id={tenant_b.tenant.pk}")
    assert forged.status_code == 404
    assert _ids(tenant_a.client.get(f"/api/v1/caches?tenant_id={tenant_a.tenant.pk}")) == mine


def test_list_paginates_and_filters_by_state(tenant_a, node):
    ids = [_attach(tenant_a, f"a{i}")["id"] for i in range(3)]
    make_ready(ids[0])
    page = tenant_a.client.get("/api/v1/caches?limit=2").json()
    assert page["count"] == 3 and len(page["results"]) == 2 and page["next"]
    assert _ids(tenant_a.client.get("/api/v1/caches?state=ready")) == {ids[0]}
    assert tenant_a.client.get("/api/v1/caches?state=bogus").status_code == 400
    assert tenant_a.client.get("/api/v1/caches?tenant_id=not-a-uuid").status_code == 400


def test_another_tenants_cache_is_404_on_every_endpoint(tenant_a, tenant_b, node):
    victim = make_ready(_attach(tenant_a)["id"])
    for cache_id in (victim.pk, uuid.uuid4()):  # a real id of another tenant and a guessed one look the same
        url = f"/api/v1/caches/{cache_id}"
        responses = [
            tenant_b.client.get(url),
            tenant_b.client.delete(url),
            tenant_b.client.post(f"{url}/tokens", {}, format="json"),
        ]
        for response in responses:
            assert response.status_code == 404, response.content
            assert response.json() == {"error": {"code": "not_found", "message": "No such cache.", "details": {}}}
    victim.refresh_from_db()
    assert victim.state == CacheState.READY


def test_malformed_ids_are_404(tenant_a):
    for url in ("/api/v1/caches/123", "/api/v1/caches/../keys", "/api/v1/caches/not-a-uuid/tokens"):
        assert tenant_a.client.get(url).status_code == 404


def test_staff_see_every_tenant_and_can_confine(tenant_a, tenant_b, node, staff_client):
    a, b = _attach(tenant_a)["id"], _attach(tenant_b)["id"]
    assert _ids(staff_client.get("/api/v1/caches")) >= {a, b}
    assert _ids(staff_client.get(f"/api/v1/caches?tenant_id={tenant_b.tenant.pk}")) == {b}
    assert staff_client.get(f"/api/v1/caches?tenant_id={uuid.uuid4()}").status_code == 404
    assert staff_client.get(f"/api/v1/caches/{a}").json()["id"] == a
    assert staff_client.delete(f"/api/v1/caches/{a}").status_code == 202


def test_read_scope_cannot_attach_or_detach(tenant_a, node):
    cache_id = _attach(tenant_a)["id"]
    reader = tenant_a.key("caches:read")
    assert reader.get("/api/v1/caches").status_code == 200
    assert reader.get(f"/api/v1/caches/{cache_id}").status_code == 200
    for response in (
        reader.post("/api/v1/caches", attach_body(name="c2"), format="json"),
        reader.delete(f"/api/v1/caches/{cache_id}"),
    ):
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "permission_denied"
        assert response.json()["error"]["details"]["required_scope"] == "caches:write"
    assert Cache.objects.get(pk=cache_id).state == CacheState.PROVISIONING
    assert Cache.objects.count() == 1


def test_keys_without_caches_scope_see_nothing(tenant_a, node):
    cache_id = _attach(tenant_a)["id"]
    other_scope = tenant_a.key("keys:write", "usage:read")
    for response in (other_scope.get("/api/v1/caches"), other_scope.get(f"/api/v1/caches/{cache_id}")):
        assert response.status_code == 403
        assert response.json()["error"]["details"]["required_scope"] == "caches:read"


def test_unauthenticated_and_bad_keys_are_401(client, tenant_a, node, fast_password_hasher):
    cache_id = _attach(tenant_a)["id"]
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer kc_live_nope"}, {"HTTP_AUTHORIZATION": "Basic Zm9vOmJhcg=="}):
        for method, url in (
            ("get", "/api/v1/caches"),
            ("get", f"/api/v1/caches/{cache_id}"),
            ("delete", f"/api/v1/caches/{cache_id}"),
            ("post", "/api/v1/caches"),
        ):
            response = getattr(client, method)(url, **headers)
            assert response.status_code == 401, (method, url, headers, response.content)
            assert set(response.json()["error"]) == {"code", "message", "details"}


def test_listing_costs_the_same_queries_for_1_or_20_caches(make_tenant, node):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    tenant = make_tenant(max_caches=20)

    def queries_for_list() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert tenant.client.get("/api/v1/caches").status_code == 200
        return len(captured.captured_queries)

    _attach(tenant, "first")
    one = queries_for_list()
    for i in range(19):
        _attach(tenant, f"more{i}")
    # key lookup (with tenant and quota), count, page, and the page's nodes' resident snapshots (`contents`: one
    # query for every node of the page, never one per cache)
    assert queries_for_list() == one <= 4
