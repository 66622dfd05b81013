"""Fleet and cache fixtures for the overview and nodes pages, made through the rooms' own services: nodes created,
registered and heartbeating (fleet.services), tenants (tenants.services), caches attached and answered as their node
would (caches.services). Orders to nodes leave on commit, which a non-transactional test never reaches."""

from __future__ import annotations

import itertools
import uuid

from caches import services as cache_services
from caches.models import Cache
from fleet import services as fleet_services
from fleet.models import Node
from kcaas.spec import KVCacheSpec
from tenants import services as tenant_services

GIB = 2**30
BLOCK = 2048  # bytes per block of SPEC: 2 layers x 2 (K, V) x 2 heads x 8 dims x 2 bytes x 16 tokens
SPEC = KVCacheSpec.from_dict(
    {
        "model_fingerprint": "tiny-llama@rev1",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "block_size": 16,
        "kv_dtype": "float16",
        "storage_dtype": "float16",
    }
)
_ports = itertools.count(7401)
_names = itertools.count(1)


def make_node(name: str, *, device: int = 8 * GIB, dram: int = 0, ssd: int = 0, register: bool = True) -> Node:
    issued = fleet_services.node_create(name=name)
    if register:
        fleet_services.node_register(
            node_id=issued.node.pk,
            endpoint=f"10.9.0.1:{next(_ports)}",
            capacity={"device": device, "dram": dram, "ssd": ssd},
        )
    return Node.objects.get(pk=issued.node.pk)


def heartbeat(node: Node, resident: list[dict]) -> Node:
    """A heartbeat with the node's current capacity and this resident snapshot."""
    return fleet_services.node_heartbeat(node_id=node.pk, capacity=node.capacity, resident=resident)


def make_tenant(name: str | None = None):
    return tenant_services.tenant_create(name=name or f"tenant-{next(_names)}-{uuid.uuid4().hex[:6]}")


def attach(tenant, name: str, *, device: int = 8 * BLOCK, dram: int = 0, ssd: int = 0) -> Cache:
    """A cache placed by the fleet's best fit, in state provisioning."""
    return cache_services.cache_attach(
        tenant_id=tenant.pk, name=name, spec=SPEC, capacity={"device": device, "dram": dram, "ssd": ssd}
    )


def make_ready(cache: Cache) -> Cache:
    return cache_services.cache_provision_result(cache_id=cache.pk, node_id=cache.node_id, ok=True)


def make_failed(cache: Cache) -> Cache:
    return cache_services.cache_provision_result(cache_id=cache.pk, node_id=cache.node_id, ok=False, reason="test")
