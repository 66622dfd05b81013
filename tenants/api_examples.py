"""Request and response examples for the API-key operations of the published reference."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

TENANT_ID = "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b"
KEY_ID = "7d1e2f3a-4b5c-4d6e-9f80-a1b2c3d4e5f6"

KEY = {
    "id": KEY_ID,
    "tenant_id": TENANT_ID,
    "name": "ci",
    "public_id": "q7Hc2LkPx4Rt9Wm2",
    "scopes": ["caches:read", "caches:write"],
    "state": "active",
    "created_at": "2026-03-02T09:00:00Z",
    "expires_at": "2026-06-01T09:00:00Z",
    "revoked_at": None,
    "last_used_at": "2026-03-02T10:14:55Z",
    "use_count": 42,
    "rotated_from": None,
}

KEY_LIST = OpenApiExample("One page of keys", value=KEY, response_only=True, status_codes=["200"])
KEY_CREATE = OpenApiExample(
    "A CI key that can attach caches, for 90 days",
    value={"name": "ci", "scopes": ["caches:read", "caches:write"], "expires_in_seconds": 7_776_000},
    request_only=True,
)
KEY_ISSUED = OpenApiExample(
    "Issued (the raw key is shown once)",
    value={
        **KEY,
        "last_used_at": None,
        "use_count": 0,
        "key": "kc_live_q7Hc2LkPx4Rt9Wm2_EXAMPLEonlyEXAMPLEonlyEXAMPLEonlyEXAMPLEonl11rzTW",
    },
    response_only=True,
    status_codes=["201"],
)
WHOAMI = OpenApiExample(
    "A tenant key",
    value={"kind": "tenant_key", "tenant_id": TENANT_ID, "key_id": KEY_ID, "scopes": ["caches:read", "caches:write"]},
    response_only=True,
    status_codes=["200"],
)
