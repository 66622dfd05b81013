"""Cascading revocation (caches/token_cascade.py): revoking or expiring an API key, or suspending a tenant, ends the
data tokens under it — listed to their node in every heartbeat/register answer at once, then marked revoked and
pushed (through the outbox's revoke_tokens order) by the cascade, which beat and the console run."""

from datetime import timedelta

import pytest
from django.utils import timezone

from caches.models import DataToken
from caches.selectors import data_tokens_revoked_on_node
from caches.token_cascade import data_tokens_revoke_cascade
from fleet.models import NodeOrder
from kcaas.node_protocol.messages import REVOKE_TOKENS_TASK
from tenants import services as tenant_services
from tenants.models import ApiKey, Tenant
from tests.caches.conftest import attach_body, make_ready

pytestmark = pytest.mark.django_db


def ready_cache(handle, name: str):
    response = handle.client.post("/api/v1/caches", attach_body(name=name), format="json")
    assert response.status_code == 201, response.content
    return make_ready(response.json()["id"])


def issue(client, cache_id) -> str:
    response = client.post(f"/api/v1/caches/{cache_id}/tokens", {"access": "readwrite"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["jti"]


def listed(node) -> set[str]:
    return {entry["jti"] for entry in data_tokens_revoked_on_node(node_id=node.pk)}


def revoke_orders(node) -> list[set[str]]:
    orders = NodeOrder.objects.filter(node_id=node.pk, task=REVOKE_TOKENS_TASK).order_by("created_at")
    return [{entry["jti"] for entry in order.args["entries"]} for order in orders]


def test_a_revoked_keys_tokens_are_listed_at_once_then_revoked_and_pushed_and_no_other(make_tenant, node):
    a, b = make_tenant(), make_tenant()
    cache_a, cache_b = ready_cache(a, "a"), ready_cache(b, "b")
    other_key = a.key("caches:write")
    by_key = [issue(a.client, cache_a.pk) for _ in range(2)]
    by_other_key = issue(other_key, cache_a.pk)
    tenant_b_token = issue(b.client, cache_b.pk)
    first_key = ApiKey.objects.get(pk=DataToken.objects.get(jti=by_key[0]).api_key_id)
    assert first_key.tenant_id == a.tenant.pk  # the key that asked is recorded on the token

    tenant_services.api_key_revoke(api_key=first_key)  # as the REST API does: the tenants room alone
    assert listed(node) == set(by_key)  # in the node's next heartbeat answer, before anything else ran
    assert data_tokens_revoke_cascade() == 2
    assert DataToken.objects.filter(jti__in=by_key, revoked_at__isnull=False).count() == 2
    assert revoke_orders(node) == [set(by_key)]  # pushed to the cache's node
    assert data_tokens_revoke_cascade() == 0  # idempotent
    assert (
        not DataToken.objects.get(jti=by_other_key).revoked_at
        and not DataToken.objects.get(jti=tenant_b_token).revoked_at
    )


def test_a_suspended_tenant_loses_every_data_token_and_gets_new_ones_when_reactivated(make_tenant, node):
    a, b = make_tenant(), make_tenant()
    cache_a, cache_b = ready_cache(a, "a"), ready_cache(b, "b")
    tokens_a = {issue(a.client, cache_a.pk), issue(a.key("caches:write"), cache_a.pk)}
    token_b = issue(b.client, cache_b.pk)
    tenant_services.tenant_set_status(tenant=a.tenant, status=Tenant.Status.SUSPENDED)
    assert listed(node) == tokens_a
    assert data_tokens_revoke_cascade(tenant_id=b.tenant.pk) == 0  # scoped to one tenant: not a's
    assert data_tokens_revoke_cascade(tenant_id=a.tenant.pk) == 2
    assert revoke_orders(node) == [tokens_a]
    assert a.client.post(f"/api/v1/caches/{cache_a.pk}/tokens", {"access": "read"}, format="json").status_code == 401
    tenant_services.tenant_set_status(tenant=Tenant.objects.get(pk=a.tenant.pk), status=Tenant.Status.ACTIVE)
    fresh = issue(a.client, cache_a.pk)
    assert fresh not in listed(node) and tokens_a <= listed(node)  # the old ones stay refused until they expire
    assert token_b not in listed(node)


def test_an_expired_keys_tokens_are_cut_off_too(make_tenant, node):
    a = make_tenant()
    cache = ready_cache(a, "a")
    jti = issue(a.client, cache.pk)
    key = ApiKey.objects.get(pk=DataToken.objects.get(jti=jti).api_key_id)
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert jti in listed(node)
    assert data_tokens_revoke_cascade() == 1
