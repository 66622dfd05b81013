"""The SDK's client.recover and `kcaas recover NAME` against the live control plane: a cache with a network tier
whose node was lost is re-placed on another node; anything else is a 409 the caller reads (code, exit 1)."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from caches import services
from fleet.models import Node
from kcaas.errors import KcaasError
from tests.caches.conftest import BLOCK_BYTES, SPEC, purge_node_queue
from tests.kcaas.test_cli import SPEC_FLAGS, cli  # noqa: F401 - the cli fixture reused

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def store(settings):
    settings.KCAAS_NETWORK_STORE_BYTES = 64 * BLOCK_BYTES


def _lose(node) -> None:
    Node.objects.filter(pk=node.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    services.caches_sweep_leases()


def test_the_sdk_attaches_with_a_network_tier_and_recovers_a_node_lost_cache(make_tenant, node, make_node, sdk):
    client = sdk(make_tenant().raw_key)
    capacity = {"device": 8 * BLOCK_BYTES, "network": 16 * BLOCK_BYTES}
    cache = client.attach("net", SPEC, capacity, network_write_through=True, timeout=20)
    assert cache.state == "ready" and cache.network_write_through is True
    assert cache.capacity == {"device": 8 * BLOCK_BYTES, "dram": 0, "ssd": 0, "network": 16 * BLOCK_BYTES}
    with pytest.raises(KcaasError) as ready:
        client.recover(cache.id)
    assert ready.value.code == "cache_not_node_lost"
    spare = make_node()
    _lose(node)
    assert client.get_cache(cache.id).failure_reason == "node_lost"
    recovered = client.recover(cache.id)
    assert (recovered.state, recovered.node_id, recovered.epoch) == ("provisioning", str(spare.pk), 2)
    purge_node_queue(spare.pk)


def test_kcaas_recover_by_name_and_its_409_without_a_network_tier(make_tenant, node, make_node, cli):
    key = make_tenant().raw_key
    attach = ("attach", "chat", *SPEC_FLAGS, "--device-bytes", "16KiB", "--network-bytes", "32KiB")
    code, out, err = cli(key, *attach, "--network-write-through", "--timeout", "20")
    assert code == 0, err
    shown = dict(line.split(":", 1) for line in out.splitlines())
    assert shown["capacity"].strip() == "device 16 KiB, network 32 KiB"
    assert shown["write-through"].strip() == "network"
    code, _, err = cli(key, *("attach", "plain", *SPEC_FLAGS, "--device-bytes", "16KiB", "--timeout", "20"))
    assert code == 0, err
    spare = make_node()
    _lose(node)

    code, out, err = cli(key, "recover", "chat")
    assert code == 0, err
    assert out.strip().endswith(f"chat: provisioning on node {spare.pk} (epoch 2)")
    code, out, err = cli(key, "--json", "show", "chat")
    assert json.loads(out)["node_id"] == str(spare.pk)
    code, out, err = cli(key, "recover", "plain")
    assert code == 1 and "cache_without_network_tier" in err
    purge_node_queue(spare.pk)
