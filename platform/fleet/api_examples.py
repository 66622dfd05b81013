"""Request and response examples for the staff node operations of the published reference (an H100 node: 80 GB of
HBM, of which 64 GiB for caches, 512 GiB of DRAM and 4 TiB of SSD)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

GIB = 2**30
NODE_ID = "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f"
CACHE_ID = "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10"
CAPACITY = {"device": 64 * GIB, "dram": 512 * GIB, "ssd": 4096 * GIB}
RESERVED = {"device": 8 * GIB, "dram": 32 * GIB, "ssd": 0}

NODE = {
    "id": NODE_ID,
    "name": "node-7",
    "endpoint": "node-7.kcaas.example:7443",
    "state": "ready",
    "capacity": CAPACITY,
    "reserved": RESERVED,
    "free": {tier: CAPACITY[tier] - RESERVED[tier] for tier in CAPACITY},
    "lease_expires_at": "2026-03-02T10:15:30Z",
    "last_heartbeat_at": "2026-03-02T10:15:00Z",
    "registered_at": "2026-03-01T08:05:00Z",
    "created_at": "2026-03-01T08:00:00Z",
}
_ZERO = {"device": 0, "dram": 0, "ssd": 0}

NODE_LIST = OpenApiExample(
    "One page of nodes",
    value={"count": 1, "next": None, "previous": None, "results": [NODE]},
    response_only=True,
    status_codes=["200"],
)
NODE_CREATE = OpenApiExample("A new node", value={"name": "node-7"}, request_only=True)
NODE_CREATED = OpenApiExample(
    "Created: the agent registers with this credential (shown once)",
    value={
        "node": {
            **NODE,
            "endpoint": "",
            "state": "registering",
            "capacity": _ZERO,
            "reserved": _ZERO,
            "free": _ZERO,
            "lease_expires_at": None,
            "last_heartbeat_at": None,
            "registered_at": None,
        },
        "credential": "kc_node_N7dQ2wXk9Lm4Rp8T_EXAMPLEonlyEXAMPLEonlyEXAMPLEonlyEXAMPLEonl2Xsed6",
    },
    response_only=True,
    status_codes=["201"],
)
NODE_DETAIL = OpenApiExample(
    "A ready node holding one cache",
    value={
        **NODE,
        "resident": {
            "reported_at": "2026-03-02T10:15:00+00:00",
            "caches": {CACHE_ID: {"device": 6 * GIB, "dram": 11 * GIB, "ssd": 0, "network": 0}},
        },
    },
    response_only=True,
    status_codes=["200"],
)
NODE_CORDONED = OpenApiExample(
    "Cordoned", value={**NODE, "state": "cordoned"}, response_only=True, status_codes=["200"]
)
NODE_UNCORDONED = OpenApiExample("Ready again", value=NODE, response_only=True, status_codes=["200"])
