"""Request and response examples for the caches and tokens operations of the published reference (the values are
ones the API would return for a Llama-3-8B cache in fp16: 32 layers, 8 KV heads of 128, 16-token blocks)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

CACHE_ID = "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10"
TENANT_ID = "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b"
NODE_ID = "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f"

SPEC = {
    "model_fingerprint": "meta-llama/Meta-Llama-3-8B@main",
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "block_size": 16,
    "kv_dtype": "float16",
    "storage_dtype": "float16",
}
CAPACITY = {"device": 8 * 2**30, "dram": 32 * 2**30, "ssd": 0, "network": 0}

CACHE = {
    "id": CACHE_ID,
    "tenant_id": TENANT_ID,
    "name": "llama3-8b-chat",
    "spec": {**SPEC, "attention": "mha", "kv_lora_rank": 0, "qk_rope_head_dim": 0},
    "capacity": CAPACITY,
    "network_write_through": False,
    "block_bytes": 2 * 32 * 8 * 128 * 16 * 2,
    "state": "ready",
    "failure_reason": "",
    "node_id": NODE_ID,
    "endpoint": "node-7.kcaas.example:7443",
    "epoch": 1,
    "contents": "warm",
    "emptied_at": None,
    "created_at": "2026-03-02T10:15:00Z",
    "updated_at": "2026-03-02T10:15:04Z",
}

ATTACH_REQUEST = OpenApiExample(
    "Attach a Llama-3-8B cache",
    value={"name": "llama3-8b-chat", "spec": SPEC, "capacity": {"device": 8 * 2**30, "dram": 32 * 2**30}},
    request_only=True,
)
ATTACHED = OpenApiExample(
    "Attached: placed on a node, provisioning",
    value={**CACHE, "state": "provisioning", "endpoint": "", "contents": None, "updated_at": CACHE["created_at"]},
    response_only=True,
    status_codes=["201"],
)
CACHE_READY = OpenApiExample("A ready cache", value=CACHE, response_only=True, status_codes=["200"])
# a list's example is one item: drf-spectacular wraps it in the page (controlplane.openapi fills the page's links)
CACHE_LIST = OpenApiExample("One page of caches", value=CACHE, response_only=True, status_codes=["200"])
DETACHING = OpenApiExample(
    "Detaching", value={**CACHE, "state": "detaching", "contents": None}, response_only=True, status_codes=["202"]
)
TOKEN_REQUEST = OpenApiExample(
    "A read-write token for ten minutes", value={"access": "readwrite", "ttl_seconds": 600}, request_only=True
)
TOKEN_ISSUED = OpenApiExample(
    "Issued",
    value={
        "token": "eyJhbGciOiJFZERTQSIsImtpZCI6InRvay0xIiwidHlwIjoiSldUIn0.eyJhdWQiOiJjYWNoZTo1ZjBj...In0.MEUCIQ...",
        "token_type": "Bearer",
        "jti": "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",
        "cache_id": CACHE_ID,
        "access": "readwrite",
        "epoch": 1,
        "node_id": NODE_ID,
        "endpoint": "node-7.kcaas.example:7443",
        "expires_at": "2026-03-02T10:25:00Z",
    },
    response_only=True,
    status_codes=["201"],
)
RECOVERING = OpenApiExample(
    "Re-placed on another node at a new epoch",
    value={
        **CACHE,
        "state": "provisioning",
        "node_id": "d4e5f6a7-b8c9-4d0e-9f1a-2b3c4d5e6f70",
        "endpoint": "",
        "epoch": 2,
        "contents": None,
    },
    response_only=True,
    status_codes=["202"],
)
TOKEN_REVOKED = OpenApiExample("One token revoked", value={"revoked": 1}, response_only=True, status_codes=["200"])
TOKENS_REVOKED = OpenApiExample(
    "Every outstanding token revoked", value={"revoked": 4}, response_only=True, status_codes=["200"]
)
JWKS = OpenApiExample(
    "The current signing key",
    value={
        "keys": [
            {
                "kty": "OKP",
                "crv": "Ed25519",
                "x": "Eb8SAssQJ6GDOieQvug6DDzmoDo5Lg0D5ePI7f7TYcs",
                "kid": "xYYm359zE0s8d_mp5QA2G6F185TSPZ1Um4iXbcGyG0Q",
                "use": "sig",
                "alg": "EdDSA",
            }
        ]
    },
    response_only=True,
    status_codes=["200"],
)

# ---- staff: draining node-7, which hosts the cache above -----------------------------------------------------------

NODE_DRAINED = OpenApiExample(
    "Draining: its one ready cache is moving to another node",
    value={
        "node_id": NODE_ID,
        "migrations": [
            {
                "id": "2e4a6c8e-0b1d-4f3a-8c5e-7a9b1c3d5e7f",
                "cache_id": CACHE_ID,
                "source_id": NODE_ID,
                "target_id": "d4e5f6a7-b8c9-4d0e-9f1a-2b3c4d5e6f70",
                "epoch_from": 1,
                "epoch_to": 2,
                "reason": "drain",
                "state": "pending",
            }
        ],
    },
    response_only=True,
    status_codes=["200"],
)
NODE_NOT_DRAINABLE = OpenApiExample(
    "A lost node cannot be drained",
    value={
        "error": {
            "code": "invalid_node_state",
            "message": "A lost node cannot be drained.",
            "details": {"state": "lost", "allowed": ["cordoned", "ready"]},
        }
    },
    response_only=True,
    status_codes=["409"],
)
NODE_UNKNOWN = OpenApiExample(
    "No such node",
    value={"error": {"code": "not_found", "message": "No such node.", "details": {"node_id": NODE_ID}}},
    response_only=True,
    status_codes=["404"],
)
