"""Request and response examples for the API-key operations of the published reference."""

from __future__ import annotations

import json

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
KEY_ONE = OpenApiExample("An active key", value=KEY, response_only=True, status_codes=["200"])
KEY_REVOKED = OpenApiExample(
    "Revoked",
    value={**KEY, "state": "revoked", "revoked_at": "2026-03-02T10:20:00Z"},
    response_only=True,
    status_codes=["200"],
)
KEY_ROTATE = OpenApiExample("Keep the old key working for an hour", value={"overlap_seconds": 3600}, request_only=True)
KEY_SUCCESSOR = OpenApiExample(
    "The successor (the raw key is shown once)",
    value={
        **KEY,
        "id": "8e2f3a4b-5c6d-4e7f-8a90-b1c2d3e4f5a6",
        "public_id": "Zr4Tn8Vb2Kc6Xq1W",
        "created_at": "2026-03-02T10:20:00Z",
        "last_used_at": None,
        "use_count": 0,
        "rotated_from": KEY_ID,
        "key": "kc_live_Zr4Tn8Vb2Kc6Xq1W_EXAMPLEonlyEXAMPLEonlyEXAMPLEonlyEXAMPLEonl4W2vUe",
    },
    response_only=True,
    status_codes=["201"],
)

# ---- staff: tenants and quotas --------------------------------------------------------------------------------------

TENANT = {"id": TENANT_ID, "name": "acme", "status": "active", "created_at": "2026-03-01T08:00:00Z"}
TENANT_LIST = OpenApiExample("One page of tenants", value=TENANT, response_only=True, status_codes=["200"])
TENANT_CREATE = OpenApiExample(
    "A new tenant with 8 GiB of device memory",
    value={"name": "acme", "quota": {"max_device_bytes": "8GiB"}},
    request_only=True,
)
TENANT_CREATED = OpenApiExample("Created", value=TENANT, response_only=True, status_codes=["201"])
TENANT_ONE = OpenApiExample("An active tenant", value=TENANT, response_only=True, status_codes=["200"])
TENANT_SUSPEND = OpenApiExample("Suspend", value={"status": "suspended"}, request_only=True)
TENANT_SUSPENDED = OpenApiExample(
    "Suspended", value={**TENANT, "status": "suspended"}, response_only=True, status_codes=["200"]
)

_NO_OVERRIDES = dict.fromkeys(
    (
        "max_caches",
        "max_device_bytes",
        "max_dram_bytes",
        "max_ssd_bytes",
        "max_network_bytes",
        "max_requests_per_second",
        "max_data_tokens_outstanding",
        "max_api_keys",
    )
)
QUOTA = {
    "tenant_id": TENANT_ID,
    "max_caches": 10,
    "max_device_bytes": 64 * 2**30,
    "max_dram_bytes": 256 * 2**30,
    "max_ssd_bytes": 1024 * 2**30,
    "max_network_bytes": 0,
    "max_requests_per_second": 50,
    "max_data_tokens_outstanding": 1000,
    "max_api_keys": 20,
    "overrides": _NO_OVERRIDES,
}
QUOTA_DEFAULTS = OpenApiExample("The defaults, no override", value=QUOTA, response_only=True, status_codes=["200"])
QUOTA_PATCH = OpenApiExample(
    "Raise the device limit, reset the rate to the default",
    value={"max_device_bytes": "128GiB", "max_requests_per_second": None},
    request_only=True,
)
QUOTA_PATCHED = OpenApiExample(
    "Patched",
    value={**QUOTA, "max_device_bytes": 128 * 2**30, "overrides": {**_NO_OVERRIDES, "max_device_bytes": 128 * 2**30}},
    response_only=True,
    status_codes=["200"],
)


def curl_samples(method: str, path: str, body: dict | None = None) -> list[dict]:
    """The reference's curl sample for a tenant-scoped operation staff may call too: the tenant key's request, then
    the staff form, which names the tenant as the query parameter `?tenant_id=` (as on every tenant-scoped
    operation; a body's `tenant_id` is deprecated)."""

    def one(url: str, auth: str) -> str:
        lines = [f'curl -sS "{url}"' if method == "get" else f'curl -sS -X {method.upper()} "{url}"', auth]
        if body is not None:
            lines += ['-H "Content-Type: application/json"', "-d '" + json.dumps(body).replace("'", "'\\''") + "'"]
        return " \\\n  ".join(lines)

    tenant = one(f"$KCAAS_URL{path}", '-H "Authorization: Bearer $KCAAS_API_KEY"')
    staff = one(f"$KCAAS_URL{path}?tenant_id=$TENANT_ID", '-u "$KCAAS_ADMIN_USER:$KCAAS_ADMIN_PASSWORD"')
    source = f"{tenant}\n\n# staff (HTTP basic) name the tenant with ?tenant_id=\n{staff}"
    return [{"lang": "Shell", "label": "curl", "source": source}]
