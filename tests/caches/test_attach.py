"""POST /api/v1/caches: validation codes, the created cache, the message to its node, quota refusals."""

import pytest

from caches.models import Cache, CacheState
from caches.sealing import hash_key_unseal
from core.celery import app as celery_app
from kcaas.node_protocol.messages import PROVISION_TASK, ProvisionCache, node_queue
from tests.caches.conftest import BLOCK_BYTES, GIB, SPEC, attach_body, purge_node_queue, reserved
from tests.fleet.node_keys import opened

pytestmark = pytest.mark.django_db

URL = "/api/v1/caches"


def _post(client, body, **headers):
    return client.post(URL, body, format="json", **headers)


def _error(response, status, code):
    assert response.status_code == status, response.content
    body = response.json()
    assert body["error"]["code"] == code, body
    return body["error"]


@pytest.mark.parametrize(
    "spec_change, field",
    [
        ({"kv_dtype": "float64"}, "kv_dtype"),
        ({"storage_dtype": "int4"}, "storage_dtype"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"num_layers": -1}, "num_layers"),
        ({"head_dim": "eight"}, "head_dim"),
        ({"block_size": 4096}, "block_size"),
        ({"model_fingerprint": ""}, "model_fingerprint"),
    ],
)
def test_invalid_spec_is_400_invalid_spec_naming_the_field(tenant_a, node, spec_change, field):
    error = _error(_post(tenant_a.client, attach_body(**spec_change)), 400, "invalid_spec")
    assert field in error["details"]["fields"]["spec"]
    assert not Cache.objects.exists()


def test_a_latent_spec_attaches_with_its_heads_and_head_dim_implied(tenant_a, node):
    body = attach_body(attention="mla", kv_lora_rank=512, qk_rope_head_dim=64, num_layers=3)
    del body["spec"]["num_kv_heads"], body["spec"]["head_dim"]
    response = _post(tenant_a.client, body)
    assert response.status_code == 201, response.content
    spec = response.json()["spec"]
    assert (spec["attention"], spec["kv_lora_rank"], spec["qk_rope_head_dim"]) == ("mla", 512, 64)
    assert (spec["num_kv_heads"], spec["head_dim"]) == (1, 288)
    assert response.json()["block_bytes"] == 16 * 3 * 576 * 2  # one fp16 latent row per token and layer


def test_a_spec_without_the_attention_fields_is_a_kv_spec(tenant_a, node):
    body = attach_body()
    for name in ("attention", "kv_lora_rank", "qk_rope_head_dim"):
        del body["spec"][name]
    response = _post(tenant_a.client, body)
    assert response.status_code == 201, response.content
    assert response.json()["spec"] == SPEC


@pytest.mark.parametrize(
    "spec_change",
    [
        {"attention": "mla", "kv_lora_rank": 0, "qk_rope_head_dim": 64},  # no latent
        {"attention": "mla", "kv_lora_rank": 511, "qk_rope_head_dim": 64},  # odd width
        {"attention": "mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64},  # heads/head_dim of a K/V spec given
        {"attention": "mha", "kv_lora_rank": 512},  # latent widths on a K/V spec
        {"attention": "gqa"},
    ],
)
def test_an_inconsistent_attention_spec_is_400_invalid_spec(tenant_a, node, spec_change):
    error = _error(_post(tenant_a.client, attach_body(**spec_change)), 400, "invalid_spec")
    assert error["details"]["fields"]["spec"]
    assert not Cache.objects.exists()


def test_missing_spec_field_is_invalid_spec(tenant_a, node):
    body = attach_body()
    del body["spec"]["head_dim"]
    error = _error(_post(tenant_a.client, body), 400, "invalid_spec")
    assert "head_dim" in error["details"]["fields"]["spec"]


@pytest.mark.parametrize(
    "capacity, tier",
    [
        ({"device": BLOCK_BYTES - 1}, "device"),
        ({"device": BLOCK_BYTES, "dram": 100}, "dram"),
        ({"device": BLOCK_BYTES, "ssd": BLOCK_BYTES // 2}, "ssd"),
    ],
)
def test_capacity_below_one_block_is_400_invalid_capacity(tenant_a, node, capacity, tier):
    body = attach_body() | {"capacity": capacity}
    error = _error(_post(tenant_a.client, body), 400, "invalid_capacity")
    assert tier in error["details"]["fields"]["capacity"]
    assert error["details"]["block_bytes"] == BLOCK_BYTES


@pytest.mark.parametrize("capacity", [{"device": 0}, {"device": -5}, {"dram": GIB}, {"device": 2**62}, {}])
def test_out_of_range_capacity_is_400_invalid_capacity(tenant_a, node, capacity):
    _error(_post(tenant_a.client, attach_body() | {"capacity": capacity}), 400, "invalid_capacity")


@pytest.mark.parametrize("name", ["", "-lead", "has space", "x" * 64, None])
def test_bad_name_is_400_validation_error(tenant_a, node, name):
    error = _error(_post(tenant_a.client, attach_body(name=name)), 400, "validation_error")
    assert "name" in error["details"]["fields"]


def test_malformed_json_and_wrong_types_are_400(tenant_a, node):
    response = tenant_a.client.post(URL, data=b"{not json", content_type="application/json")
    _error(response, 400, "malformed_request")
    _error(_post(tenant_a.client, ["a", "list"]), 400, "validation_error")
    _error(_post(tenant_a.client, attach_body() | {"spec": "fp16"}), 400, "invalid_spec")


def test_quantized_layout_sizes_blocks_with_scales(tenant_a, node):
    # int8 storage: 1 byte per element plus a 4-byte scale per (token, layer, K/V, head): 16*(2*2*2*8 + 2*2*2*4)
    body = attach_body(storage_dtype="int8", device=16 * (64 + 32) - 1)
    error = _error(_post(tenant_a.client, body), 400, "invalid_capacity")
    assert error["details"]["block_bytes"] == 16 * (64 + 32)


def test_attach_creates_a_provisioning_cache_placed_on_a_node(tenant_a, node):
    response = _post(tenant_a.client, attach_body(device=10 * BLOCK_BYTES, dram=20 * BLOCK_BYTES))
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == "provisioning"
    assert body["spec"] == SPEC
    assert body["capacity"] == {"device": 10 * BLOCK_BYTES, "dram": 20 * BLOCK_BYTES, "ssd": 0, "network": 0}
    assert body["block_bytes"] == BLOCK_BYTES
    assert body["node_id"] == str(node.pk)
    assert body["tenant_id"] == str(tenant_a.tenant.pk)
    assert body["epoch"] == 1 and body["endpoint"] == "" and body["failure_reason"] == ""
    assert "hash_key" not in str(body)
    assert reserved(node) == {"device": 10 * BLOCK_BYTES, "dram": 20 * BLOCK_BYTES, "ssd": 0}
    cache = Cache.objects.get(pk=body["id"])
    assert len(hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)) == 32


def test_provisioning_is_sent_to_the_nodes_queue_on_commit(tenant_a, node, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = _post(tenant_a.client, attach_body())
    assert response.status_code == 201 and len(callbacks) == 1
    cache = Cache.objects.get(pk=response.json()["id"])
    try:
        with celery_app.connection_for_read() as conn:
            queue = conn.SimpleQueue(node_queue(node.pk))
            message = queue.get(timeout=5)
            message.ack()
            queue.close()
    finally:
        purge_node_queue(node.pk)
    assert message.headers["task"] == "kcaas.node.provision_cache"
    args, kwargs, _ = message.decode()
    assert args == []  # keyword arguments only (kcaas/node_protocol/messages.py)
    order = ProvisionCache.from_dict(kwargs)
    assert order.cache_id == str(cache.pk) and order.spec == SPEC and order.epoch == 1
    assert order.tenant_id == str(cache.tenant_id) and order.ssd_key_box == ""
    assert order.capacity == {"device": 64 * BLOCK_BYTES, "dram": 0, "ssd": 0, "network": 0}
    assert opened(order.hash_key_box, task=PROVISION_TASK, node_id=node.pk, cache_id=cache.pk) == hash_key_unseal(
        cache_id=cache.pk, sealed=cache.hash_key_sealed
    )


def test_rolled_back_attach_sends_nothing(tenant_a, make_node, django_capture_on_commit_callbacks):
    # No node: placement fails after the quota check; nothing is created, nothing scheduled.
    with django_capture_on_commit_callbacks() as callbacks:
        error = _error(_post(tenant_a.client, attach_body()), 503, "no_capacity")
    assert callbacks == [] and not Cache.objects.exists()
    assert error["details"]


def test_each_cache_gets_its_own_hash_key(tenant_a, node):
    ids = [_post(tenant_a.client, attach_body(name=f"c{i}")).json()["id"] for i in range(3)]
    keys = {hash_key_unseal(cache_id=c.pk, sealed=c.hash_key_sealed) for c in Cache.objects.filter(pk__in=ids)}
    assert len(keys) == 3


def test_names_are_unique_among_attached_caches_only(tenant_a, tenant_b, node):
    first = _post(tenant_a.client, attach_body(name="shared")).json()
    taken = _error(_post(tenant_a.client, attach_body(name="shared")), 409, "cache_name_taken")
    assert taken["details"] == {"name": "shared", "cache_id": first["id"], "state": first["state"]}  # which holds it
    assert _post(tenant_b.client, attach_body(name="shared")).status_code == 201  # another tenant: fine
    Cache.objects.filter(pk=first["id"]).update(state=CacheState.DETACHED)
    assert _post(tenant_a.client, attach_body(name="shared")).status_code == 201


def test_max_caches_counts_non_detached_caches(make_tenant, node):
    tenant = make_tenant(max_caches=2)
    ids = [_post(tenant.client, attach_body(name=f"c{i}")).json()["id"] for i in range(2)]
    error = _error(_post(tenant.client, attach_body(name="c3")), 403, "quota_exceeded")
    assert error["details"] == {"limit": "max_caches", "limit_value": 2, "in_use": 2}
    Cache.objects.filter(pk=ids[0]).update(state=CacheState.FAILED)  # failed still counts
    _error(_post(tenant.client, attach_body(name="c3")), 403, "quota_exceeded")
    Cache.objects.filter(pk=ids[0]).update(state=CacheState.DETACHED)
    assert _post(tenant.client, attach_body(name="c3")).status_code == 201


@pytest.mark.parametrize("tier", ["device", "dram", "ssd"])
def test_bytes_per_tier_are_limited(make_tenant, node, tier):
    tenant = make_tenant(**{f"max_{tier}_bytes": 5 * BLOCK_BYTES})
    sizes = {"device": BLOCK_BYTES, tier: 3 * BLOCK_BYTES}
    assert _post(tenant.client, attach_body(name="a", **sizes)).status_code == 201
    error = _error(_post(tenant.client, attach_body(name="b", **sizes)), 403, "quota_exceeded")
    assert error["details"]["limit"] == f"max_{tier}_bytes"
    assert error["details"]["in_use"] == 3 * BLOCK_BYTES and error["details"]["requested"] == 3 * BLOCK_BYTES
    sizes[tier] = 2 * BLOCK_BYTES  # exactly up to the limit is allowed
    assert _post(tenant.client, attach_body(name="b", **sizes)).status_code == 201


def test_suspended_tenant_cannot_attach_through_staff(tenant_a, node, staff_client):
    from tenants import services as tenant_services

    tenant_services.tenant_set_status(tenant=tenant_a.tenant, status="suspended")
    response = staff_client.post(f"{URL}?tenant_id={tenant_a.tenant.pk}", attach_body(), format="json")
    _error(response, 409, "tenant_inactive")


def test_staff_attach_for_a_named_tenant(tenant_a, node, staff_client):
    _error(staff_client.post(URL, attach_body(), format="json"), 400, "tenant_required")
    response = staff_client.post(f"{URL}?tenant_id={tenant_a.tenant.pk}", attach_body(), format="json")
    assert response.status_code == 201
    assert response.json()["tenant_id"] == str(tenant_a.tenant.pk)
