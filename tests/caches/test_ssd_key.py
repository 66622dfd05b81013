"""The per-cache SSD data key: generated for caches with an SSD tier, sealed under the tenant key, sent only as
provision_cache's trailing ssd_key_box (sealed to the node), and unopenable after the tenant key is destroyed
(erasure)."""

import pytest

from caches.models import Cache
from caches.sealing import HashKeyShredded, hash_key_unseal, ssd_key_unseal
from core.celery import app as celery_app
from kcaas.node_protocol.messages import PROVISION_TASK, node_queue
from tenants.tenant_keys import tenant_key_destroy
from tests.caches.conftest import BLOCK_BYTES, attach_body, purge_node_queue
from tests.fleet.node_keys import opened

pytestmark = pytest.mark.django_db


def _attach_and_read_message(tenant, node, capture, **capacity):
    with capture(execute=True):
        response = tenant.client.post("/api/v1/caches", attach_body(**capacity), format="json")
    assert response.status_code == 201, response.content
    try:
        with celery_app.connection_for_read() as conn:
            queue = conn.SimpleQueue(node_queue(node.pk))
            message = queue.get(timeout=5)
            message.ack()
            queue.close()
    finally:
        purge_node_queue(node.pk)
    args, kwargs, _ = message.decode()
    assert args == []  # keyword arguments only
    return Cache.objects.get(pk=response.json()["id"]), kwargs


def test_a_cache_with_an_ssd_tier_gets_its_own_sealed_key_in_ssd_key_box(
    tenant_a, node, django_capture_on_commit_callbacks
):
    cache, args = _attach_and_read_message(tenant_a, node, django_capture_on_commit_callbacks, ssd=64 * BLOCK_BYTES)
    ssd_key = opened(args["ssd_key_box"], task=PROVISION_TASK, node_id=node.pk, cache_id=cache.pk, field="ssd_key")
    assert len(ssd_key) == 32 and ssd_key == ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed)
    assert ssd_key != hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)
    assert ssd_key not in bytes(cache.ssd_key_sealed)  # stored sealed only


def test_a_cache_without_an_ssd_tier_sends_no_ssd_key(tenant_a, node, django_capture_on_commit_callbacks):
    cache, args = _attach_and_read_message(tenant_a, node, django_capture_on_commit_callbacks)
    assert args["ssd_key_box"] == "" and cache.ssd_key_sealed is None


def test_after_the_tenant_key_is_destroyed_the_ssd_key_does_not_open(tenant_a, node):
    response = tenant_a.client.post("/api/v1/caches", attach_body(ssd=64 * BLOCK_BYTES), format="json")
    cache = Cache.objects.get(pk=response.json()["id"])
    assert len(ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed)) == 32
    tenant_key_destroy(tenant_id=cache.tenant_id)
    with pytest.raises(HashKeyShredded):
        ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed)
