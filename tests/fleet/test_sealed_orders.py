"""Keys in orders to nodes are sealed to the receiving node (kcaas/node_protocol/sealing.py,
fleet.outbox.seal_for_node): what the broker holds is read raw from a real (private) Redis and must not contain a usable
key in any encoding; a node's sealing key comes with its authenticated registration; a node with none on record (an
agent older than key sealing) is sent no key at all and its cache fails with a reason that says so."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from caches.migration import migration_start
from caches.models import Cache, CacheState
from caches.reconcile import caches_reconcile_stuck
from caches.sealing import hash_key_unseal, ssd_key_unseal
from fleet import services as fleet_services
from fleet.models import Node, NodeOrder, OrderState
from fleet.outbox import NODE_SEALING_KEY_MISSING, orders_dispatch
from kcaas.node_protocol.messages import MIGRATE_IN_TASK, PROVISION_TASK, node_queue
from kcaas.node_protocol.sealing import NodeSealingKey
from tests.caches.conftest import (  # noqa: F401 - fixtures
    BLOCK_BYTES,
    GIB,
    attach_body,
    make_node,
    make_ready,
    make_tenant,
    tenant_a,
)
from tests.control_broker import use_broker
from tests.faults import PrivateRedis
from tests.fleet.node_keys import TEST_SEALING_KEY, TEST_SEALING_PUBLIC_KEY, opened

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(PrivateRedis.available() is not None, reason="needs redis-server"),
]


@pytest.fixture
def broker(tmp_path):
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    with use_broker(server.url):
        yield server
    server.close()


def raw_queue(server: PrivateRedis, node_id) -> list[bytes]:
    """Exactly what the broker holds for the node's queue, oldest first."""
    client = redis.Redis.from_url(server.url)
    try:
        return list(reversed(client.lrange(node_queue(node_id), 0, -1)))
    finally:
        client.close()


def message_args(raw: bytes) -> dict:
    """The message's keyword arguments (typed messages carry no positional ones)."""
    envelope = json.loads(raw)
    args, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
    assert args == []
    return kwargs


def encodings(key: bytes) -> list[bytes]:
    """Every way a key could show up in a JSON message: raw, base64 (both alphabets, padded or not), hex."""
    forms = [key, base64.b64encode(key), base64.urlsafe_b64encode(key), key.hex().encode(), key.hex().upper().encode()]
    return forms + [form.rstrip(b"=") for form in forms[1:3]]


def assert_nowhere(key: bytes, raw: bytes) -> None:
    """Neither the raw broker entry nor its decoded body (kombu base64-encodes bodies) holds the key."""
    body = base64.b64decode(json.loads(raw)["body"])
    for form in encodings(key):
        assert form not in raw and form not in body, f"the key is on the broker ({form[:12]!r}...)"


def later(minutes: float):
    return timezone.now() + timedelta(minutes=minutes)


def test_provision_cache_on_the_broker_holds_no_usable_key(broker, tenant_a, make_node):
    node = make_node()
    response = tenant_a.client.post(
        "/api/v1/caches", attach_body(device=8 * BLOCK_BYTES, ssd=64 * BLOCK_BYTES), format="json"
    )
    assert response.status_code == 201, response.content
    cache = Cache.objects.get(pk=response.json()["id"])
    hash_key = hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)
    ssd_key = ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed)
    (raw,) = raw_queue(broker, node.pk)
    assert_nowhere(hash_key, raw)
    assert_nowhere(ssd_key, raw)
    args = message_args(raw)
    assert opened(args["hash_key_box"], task=PROVISION_TASK, node_id=node.pk, cache_id=cache.pk) == hash_key
    assert (
        opened(args["ssd_key_box"], task=PROVISION_TASK, node_id=node.pk, cache_id=cache.pk, field="ssd_key") == ssd_key
    )
    assert NodeOrder.objects.get(node=node, task=PROVISION_TASK).args == [str(cache.pk), 1]  # nor in the outbox


def test_migrate_in_on_the_broker_holds_no_usable_key(broker, tenant_a, make_node):
    source, target = make_node(device=40 * BLOCK_BYTES), make_node(device=80 * BLOCK_BYTES)
    response = tenant_a.client.post(
        "/api/v1/caches", attach_body(device=8 * BLOCK_BYTES, ssd=64 * BLOCK_BYTES), format="json"
    )
    cache = make_ready(response.json()["id"])
    assert cache.node_id == source.pk
    migration_start(cache_id=cache.pk, target_node_id=target.pk)
    hash_key = hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)
    ssd_key = ssd_key_unseal(cache_id=cache.pk, sealed=cache.ssd_key_sealed)
    (raw,) = raw_queue(broker, target.pk)
    assert json.loads(raw)["headers"]["task"] == MIGRATE_IN_TASK
    assert_nowhere(hash_key, raw)
    assert_nowhere(ssd_key, raw)
    args = message_args(raw)
    assert opened(args["hash_key_box"], task=MIGRATE_IN_TASK, node_id=target.pk, cache_id=cache.pk) == hash_key
    assert (
        opened(args["ssd_key_box"], task=MIGRATE_IN_TASK, node_id=target.pk, cache_id=cache.pk, field="ssd_key")
        == ssd_key
    )


def test_a_resent_order_is_sealed_to_the_key_the_node_registered_last(broker, tenant_a, make_node):
    node = make_node()
    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
    restarted = NodeSealingKey()  # the agent restarted without a persisted key and registered a new one
    fleet_services.node_register(
        node_id=node.pk, endpoint=node.endpoint, capacity=node.capacity, sealing_public_key=restarted.public_key_b64
    )
    assert orders_dispatch(now=later(5))["sent"] == 1
    first, again = (message_args(raw)["hash_key_box"] for raw in raw_queue(broker, node.pk))
    assert opened(first, task=PROVISION_TASK, node_id=node.pk, cache_id=cache_id) == opened(
        again, task=PROVISION_TASK, node_id=node.pk, cache_id=cache_id, key=restarted
    )


def test_a_node_without_a_sealing_key_is_sent_no_key_and_its_cache_fails_saying_why(
    broker, tenant_a, make_node, settings
):
    node = make_node(sealing_public_key=None)  # an agent from before key sealing
    assert Node.objects.get(pk=node.pk).sealing_public_key == ""
    response = tenant_a.client.post("/api/v1/caches", attach_body(), format="json")
    assert response.status_code == 201 and response.json()["state"] == "provisioning"
    assert raw_queue(broker, node.pk) == []  # nothing sent: never a key in clear
    order = NodeOrder.objects.get(node=node, task=PROVISION_TASK)
    assert order.state == OrderState.PENDING and NODE_SEALING_KEY_MISSING in order.last_error
    assert orders_dispatch(now=later(5))["error"] == 1 and raw_queue(broker, node.pk) == []

    settings.KCAAS_PROVISION_DEADLINE_SECONDS = 0
    assert caches_reconcile_stuck(now=later(10)) == [Cache.objects.get().pk]
    cache = Cache.objects.get()
    assert (cache.state, cache.failure_reason) == (CacheState.FAILED, NODE_SEALING_KEY_MISSING)


def test_an_order_waiting_for_a_key_goes_once_the_node_registers_one(broker, tenant_a, make_node):
    node = make_node(sealing_public_key=None)
    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
    assert raw_queue(broker, node.pk) == []
    fleet_services.node_register(
        node_id=node.pk, endpoint=node.endpoint, capacity=node.capacity, sealing_public_key=TEST_SEALING_PUBLIC_KEY
    )  # the upgraded agent
    assert orders_dispatch(now=later(5))["sent"] == 1
    (raw,) = raw_queue(broker, node.pk)
    cache = Cache.objects.get(pk=cache_id)
    assert opened(
        message_args(raw)["hash_key_box"], task=PROVISION_TASK, node_id=node.pk, cache_id=cache_id
    ) == hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)


# ---- registration --------------------------------------------------------------------------------------------------


def _register(credential_client, **extra):
    body = {"endpoint": "10.3.3.3:7000", "capacity": {"device": GIB, "dram": 0, "ssd": 0}, **extra}
    return credential_client.post("/api/v1/nodes/register", body, format="json")


@pytest.fixture
def agent(db):
    from rest_framework.test import APIClient

    issued = fleet_services.node_create(name="sealing-node")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    client.node_id = issued.node.pk
    return client


def test_registration_records_the_nodes_sealing_key_and_a_registration_without_one_clears_it(agent):
    assert _register(agent, sealing_public_key=TEST_SEALING_PUBLIC_KEY).status_code == 200
    assert Node.objects.get(pk=agent.node_id).sealing_public_key == TEST_SEALING_PUBLIC_KEY
    assert _register(agent).status_code == 200  # an older agent again: nothing can be sealed to it any more
    assert Node.objects.get(pk=agent.node_id).sealing_public_key == ""


@pytest.mark.parametrize(
    "bad",
    [
        "not base64!",
        base64.b64encode(b"short").decode(),
        base64.b64encode(bytes(32)).decode(),  # a low-order point
        base64.b64encode(TEST_SEALING_KEY.private_bytes() + b"x").decode(),
    ],
)
def test_a_sealing_key_nothing_can_be_sealed_to_refuses_the_registration(agent, bad):
    response = _register(agent, sealing_public_key=bad)
    assert response.status_code == 400 and response.json()["error"]["code"] in (
        "invalid_sealing_key",
        "validation_error",
    )
    node = Node.objects.get(pk=agent.node_id)
    assert node.sealing_public_key == "" and node.state == "registering"  # nothing changed
