"""The node-order outbox (fleet.outbox) on a broker of the test's own that the test stops and starts: an order written
while the broker is down is not lost (the attach still answers 201, the order waits, the dispatcher publishes it
once the broker is back), orders that expect an answer are sent again until the node answers, a detach supersedes a
provisioning, an order never stores the keys its message carries, and orders to lost nodes are dropped."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from caches import services
from caches.models import Cache, CacheState
from fleet.models import Node, NodeOrder, NodeState, OrderState
from fleet.outbox import open_orders, orders_dispatch
from kcaas.node_protocol.messages import DETACH_TASK, PROVISION_TASK, DetachCache, node_queue
from tests.caches.conftest import attach_body, make_node, make_tenant, node, tenant_a  # noqa: F401 - fixtures
from tests.control_broker import use_broker
from tests.faults import PrivateRedis
from tests.fleet.node_keys import opened

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(PrivateRedis.available() is not None, reason="needs redis-server"),
]


@pytest.fixture
def broker(tmp_path):
    """A private Redis the control plane publishes to; stopped and started by the test."""
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    with use_broker(server.url):
        yield server
    server.close()


def queued(server: PrivateRedis, node_id) -> list[dict]:
    """The messages waiting on the node's queue: [{"task", "kwargs"}] in publish order (kombu pushes to the left)."""
    client = redis.Redis.from_url(server.url)
    try:
        raw = client.lrange(node_queue(node_id), 0, -1)
    finally:
        client.close()
    messages = []
    for item in reversed(raw):
        envelope = json.loads(item)
        body = json.loads(base64.b64decode(envelope["body"]))
        assert body[0] == []  # typed messages travel as keyword arguments only
        messages.append({"task": envelope["headers"]["task"], "kwargs": body[1]})
    return messages


def attach(tenant, name="c1") -> dict:
    response = tenant.client.post("/api/v1/caches", attach_body(name), format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_an_attach_while_the_broker_is_down_is_sent_once_it_is_back(broker, tenant_a, node):
    broker.stop()
    cache = attach(tenant_a)  # the change commits: the broker is not in the request's way
    (order,) = open_orders(node_id=node.pk)
    assert (order.task, order.state, order.attempts) == (PROVISION_TASK, OrderState.PENDING, 1)
    assert order.last_error, "the failed fast-path publish is recorded"
    assert orders_dispatch()["failed"] == 1  # still down: the order stays due
    broker.start()
    assert orders_dispatch()["sent"] == 1
    (message,) = queued(broker, node.pk)
    assert message["task"] == PROVISION_TASK and message["kwargs"]["cache_id"] == cache["id"]
    order.refresh_from_db()
    assert order.state == OrderState.SENT


def test_the_order_row_never_holds_the_keys_its_message_carries(broker, tenant_a, node):
    cache = attach(tenant_a)
    order = NodeOrder.objects.get(node=node, task=PROVISION_TASK)
    assert order.args == [cache["id"], 1]  # the cache id and epoch only
    (message,) = queued(broker, node.pk)
    # the hash key, unsealed into the message at send time, sealed to the node (tests/fleet/test_sealed_orders.py)
    assert (
        len(opened(message["kwargs"]["hash_key_box"], task=PROVISION_TASK, node_id=node.pk, cache_id=cache["id"])) == 32
    )
    assert message["kwargs"]["hash_key_box"] not in json.dumps(order.args)


def test_an_unanswered_order_is_sent_again_until_the_node_answers(broker, tenant_a, node):
    cache = attach(tenant_a)
    assert len(queued(broker, node.pk)) == 1
    assert orders_dispatch()["sent"] == 0  # not due yet: the node has KCAAS_ORDER_RESEND_SECONDS to answer
    later = timezone.now() + timedelta(minutes=5)
    assert orders_dispatch(now=later)["sent"] == 1
    assert [m["task"] for m in queued(broker, node.pk)] == [PROVISION_TASK, PROVISION_TASK]
    services.cache_provision_result(cache_id=cache["id"], node_id=node.pk, ok=True, endpoint="10.0.0.1:1")
    assert open_orders(node_id=node.pk) == []
    assert orders_dispatch(now=later + timedelta(hours=1))["sent"] == 0


def test_a_detach_supersedes_the_provisioning_it_follows(broker, tenant_a, node):
    broker.stop()
    cache = attach(tenant_a)
    response = tenant_a.client.delete(f"/api/v1/caches/{cache['id']}")
    assert response.status_code == 202
    (order,) = open_orders(node_id=node.pk)
    assert (
        order.task == DETACH_TASK
        and order.args == DetachCache(cache_id=cache["id"], epoch=1, forget_network=True).to_dict()
    )
    broker.start()
    orders_dispatch()
    assert [m["task"] for m in queued(broker, node.pk)] == [DETACH_TASK]  # the provisioning is never sent
    services.cache_detach_result(cache_id=cache["id"], node_id=node.pk)
    assert Cache.objects.get(pk=cache["id"]).state == CacheState.DETACHED
    assert open_orders(node_id=node.pk) == []


def test_a_repeated_delete_of_a_detaching_cache_sends_the_detach_again_now(broker, tenant_a, node):
    cache = attach(tenant_a)
    tenant_a.client.delete(f"/api/v1/caches/{cache['id']}")
    assert tenant_a.client.delete(f"/api/v1/caches/{cache['id']}").status_code == 202
    assert [m["task"] for m in queued(broker, node.pk)] == [PROVISION_TASK, DETACH_TASK, DETACH_TASK]
    assert len(open_orders(node_id=node.pk)) == 1


def test_an_order_whose_cache_moved_on_is_moot(broker, tenant_a, node):
    broker.stop()
    cache = attach(tenant_a)
    Cache.objects.filter(pk=cache["id"]).update(state=CacheState.FAILED)  # ended some other way meanwhile
    broker.start()
    assert orders_dispatch()["moot"] == 1
    assert queued(broker, node.pk) == []
    assert NodeOrder.objects.get(task=PROVISION_TASK).state == OrderState.DONE


def test_orders_to_a_lost_node_are_dropped(broker, tenant_a, node):
    broker.stop()
    attach(tenant_a)
    Node.objects.filter(pk=node.pk).update(state=NodeState.LOST)
    broker.start()
    assert orders_dispatch()["dropped"] == 1
    assert queued(broker, node.pk) == []
    assert NodeOrder.objects.get(task=PROVISION_TASK).last_error == "node_lost"


def test_a_rolled_back_change_writes_no_order(broker, make_tenant, node):
    tenant = make_tenant(max_caches=1)
    attach(tenant, "first")
    refused = tenant.client.post("/api/v1/caches", attach_body("second"), format="json")
    assert refused.status_code == 403
    assert NodeOrder.objects.filter(task=PROVISION_TASK).count() == 1
