"""Request and response examples for the privacy room's operations of the published reference: the erasure of
tenant acme (requested by staff user 7 on 10 March, run after the 24-hour grace window, its blocks purged on the two
nodes, a receipt signed by the example platform key of audit.api_examples, which verifies it: see
tests/controlplane/test_api_reference.py) and acme's portability export on 2 March, after it attached its cache."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiExample

from audit import api_examples as audit_examples

GIB = 2**30
TENANT_ID = "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b"
JOB_ID = "6a7b8c9d-0e1f-4a2b-8c3d-4e5f6a7b8c9d"
NODE_ID = "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f"  # node-7, which hosted the cache
OTHER_NODE_ID = "d4e5f6a7-b8c9-4d0e-9f1a-2b3c4d5e6f70"
CACHE_ID = "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10"

# ---- erasure (staff) ------------------------------------------------------------------------------------------------

JOB: dict[str, Any] = {
    "id": JOB_ID,
    "tenant_id": TENANT_ID,
    "state": "scheduled",
    "requested_by": "user:7",
    "requested_at": "2026-03-10T09:00:00.412907Z",
    "scheduled_for": "2026-03-11T09:00:00.412907Z",
    "started_at": None,
    "completed_at": None,
    "cancelled_at": None,
    "error": "",
    "purges": [],
    "receipt_available": False,
}
JOB_RUNNING: dict[str, Any] = {
    **JOB,
    "state": "running",
    "started_at": "2026-03-11T09:00:30.027311Z",
    "purges": [
        {"node_id": NODE_ID, "state": "pending", "send_count": 1, "confirmed_at": None, "freed_bytes": 0},
        {
            "node_id": OTHER_NODE_ID,
            "state": "confirmed",
            "send_count": 1,
            "confirmed_at": "2026-03-11T09:00:39.918445Z",
            "freed_bytes": 0,
        },
    ],
}
JOB_COMPLETE: dict[str, Any] = {
    **JOB_RUNNING,
    "state": "complete",
    "completed_at": "2026-03-11T09:01:12.684230Z",
    "purges": [
        {
            "node_id": NODE_ID,
            "state": "confirmed",
            "send_count": 1,
            "confirmed_at": "2026-03-11T09:00:41.356102Z",
            "freed_bytes": 17 * GIB,
        },
        JOB_RUNNING["purges"][1],
    ],
    "receipt_available": True,
}

ERASURE_REQUESTED = OpenApiExample(
    "Requested: scheduled after the 24-hour grace window", value=JOB, response_only=True, status_codes=["201"]
)
ERASURE_ALREADY_REQUESTED = OpenApiExample(
    "Already requested: the same job", value=JOB, response_only=True, status_codes=["200"]
)
ERASURE_RUNNING = OpenApiExample(
    "Running: one node has confirmed its purge", value=JOB_RUNNING, response_only=True, status_codes=["200"]
)
ERASURE_COMPLETE = OpenApiExample(
    "Complete: the receipt is available", value=JOB_COMPLETE, response_only=True, status_codes=["200"]
)
ERASURE_CANCELLED = OpenApiExample(
    "Cancelled inside the grace window",
    value={**JOB, "state": "cancelled", "cancelled_at": "2026-03-10T15:42:07.530126Z"},
    response_only=True,
    status_codes=["200"],
)
RECEIPT: dict[str, Any] = {
    "type": "kcaas.erasure-receipt",
    "version": 1,
    "job_id": "6a7b8c9d-0e1f-4a2b-8c3d-4e5f6a7b8c9d",
    "tenant_id": "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b",
    "tenant_pseudonym": "9e1c4b7a-2f3d-4a5e-8b6c-7d8e9f0a1b2c",
    "requested_by": "user:7",
    "requested_at": "2026-03-10T09:00:00.412907+00:00",
    "started_at": "2026-03-11T09:00:30.027311+00:00",
    "completed_at": "2026-03-11T09:01:12.684230+00:00",
    "nodes": [
        {
            "node_id": "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f",
            "confirmed_at": "2026-03-11T09:00:41.356102+00:00",
            "freed_bytes": 18253611008,
            "caches": [{"cache_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10", "freed_bytes": 18253611008}],
        },
        {
            "node_id": "d4e5f6a7-b8c9-4d0e-9f1a-2b3c4d5e6f70",
            "confirmed_at": "2026-03-11T09:00:39.918445+00:00",
            "freed_bytes": 0,
            "caches": [],
        },
    ],
    "bytes_freed": 18253611008,
    "caches": [
        {
            "cache_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10",
            "node_id": "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f",
            "created_at": "2026-03-02T10:15:00.201433+00:00",
        }
    ],
    "api_keys_revoked": [
        {"public_id": "q7Hc2LkPx4Rt9Wm2", "revoked_at": "2026-03-11T09:00:30.027311+00:00"},
        {"public_id": "Mx3Kp9Qs5Vd1Hf7J", "revoked_at": "2026-03-11T09:00:30.027311+00:00"},
    ],
    "key_material_destroyed": [
        {
            "kind": "tenant_data_key",
            "key_id": "tk_3b8e1f0c7a2d4e9b5c6f8a1d",
            "destroyed_at": "2026-03-11T09:01:12.684230+00:00",
        },
        {"kind": "cache_hash_keys_sealed", "count": 1},
    ],
    "records_deleted": {"data_tokens": 37, "idempotency_records": 4},
    "records_pseudonymised": {"tenant_name": 1, "api_key_names": 2, "cache_names": 1, "billing_invoices_kept": 1},
    "audit_events_pseudonymised": 212,
}
ERASURE_RECEIPT = OpenApiExample(
    "The signed receipt",
    value={
        "receipt": RECEIPT,
        "signature": {
            "alg": "EdDSA",
            "key_id": "2McR6VXntRHcY9gTaONoe4rdaC2O_oM52NtjoZ62GQc",
            "value": "dZDmfVCdilD5Pe21w8-Ytxy9MprFlmYPCiDi1ZnNGYxANZWOJR_H9BIOiFy6Hf_KRhJfpMwDfEbNHv7hBSrGBg",
        },
    },
    response_only=True,
    status_codes=["200"],
)


def _error(name: str, status: int, code: str, message: str, **details) -> OpenApiExample:
    return OpenApiExample(
        name,
        value={"error": {"code": code, "message": message, "details": details}},
        response_only=True,
        status_codes=[str(status)],
    )


NO_SUCH_TENANT = _error("No such tenant", 404, "not_found", "No such tenant.")
NO_ERASURE = _error("No erasure requested", 404, "not_found", "No erasure job for this tenant.")
NOT_CANCELLABLE = _error(
    "Already running",
    409,
    "erasure_not_cancellable",
    "The erasure is running; only a pending or scheduled one can be cancelled.",
    state="running",
)
NOT_COMPLETE = _error(
    "Not complete yet",
    409,
    "erasure_not_complete",
    "The erasure is running; its receipt exists once it completes.",
    state="running",
)

# ---- the portability export (GDPR Art. 20) of acme at 11:30 on 2 March --------------------------------------------

QUOTA_LIMITS = {
    "max_caches": 10,
    "max_device_bytes": 64 * GIB,
    "max_dram_bytes": 256 * GIB,
    "max_ssd_bytes": 1024 * GIB,
    "max_network_bytes": 0,
    "max_requests_per_second": 50,
    "max_data_tokens_outstanding": 1000,
    "max_api_keys": 20,
}
CACHE_CAPACITY = {"device": 8 * GIB, "dram": 32 * GIB, "ssd": 0, "network": 0}
EXPORT_FIELDS = ("seq", "occurred_at", "action", "action_name", "actor_kind", "actor_id", "target_type", "target_id")


def _exported_event(record: dict) -> dict:
    """An audit export's event record as the archive lists it (no chain links but its hash, no salt)."""
    event = {name: record[name] for name in EXPORT_FIELDS}
    for name in ("request_id", "source_ip", "old_values", "new_values", "hash"):
        event[name] = record[name]
    return event


ARCHIVE: dict[str, Any] = {
    "format": "kcaas.tenant-export",
    "version": 1,
    "generated_at": "2026-03-02T11:30:00.553710+00:00",
    "tenant": {"id": TENANT_ID, "name": "acme", "status": "active", "created_at": "2026-03-01T08:00:00+00:00"},
    "quota": {"overrides": dict.fromkeys(QUOTA_LIMITS), "effective": QUOTA_LIMITS},
    "api_keys": [
        {
            "id": "7d1e2f3a-4b5c-4d6e-9f80-a1b2c3d4e5f6",
            "public_id": "q7Hc2LkPx4Rt9Wm2",
            "name": "ci",
            "scopes": ["caches:read", "caches:write"],
            "state": "active",
            "created_at": "2026-03-02T09:00:00+00:00",
            "expires_at": "2026-06-01T09:00:00+00:00",
            "revoked_at": None,
            "last_used_at": "2026-03-02T10:20:00+00:00",
            "use_count": 42,
            "rotated_from": None,
        },
        {
            "id": "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f",
            "public_id": "Mx3Kp9Qs5Vd1Hf7J",
            "name": "compliance",
            "scopes": ["audit:read", "caches:read", "keys:read", "usage:read"],
            "state": "active",
            "created_at": "2026-03-02T11:25:00+00:00",
            "expires_at": None,
            "revoked_at": None,
            "last_used_at": None,
            "use_count": 0,
            "rotated_from": None,
        },
    ],
    "caches": [
        {
            "id": CACHE_ID,
            "name": "llama3-8b-chat",
            "spec": audit_examples.SPEC,
            "capacity": CACHE_CAPACITY,
            "state": "ready",
            "failure_reason": "",
            "node_id": NODE_ID,
            "endpoint": "node-7.kcaas.example:7443",
            "epoch": 1,
            "created_at": "2026-03-02T10:15:00.201433+00:00",
            "updated_at": "2026-03-02T10:15:04.118342+00:00",
        }
    ],
    "data_tokens": [
        {
            "jti": "4d5e6f7a-8b9c-4d0e-9f1a-2b3c4d5e6f7a",
            "cache_id": CACHE_ID,
            "access": "readwrite",
            "issued_at": "2026-03-02T10:20:00+00:00",
            "expires_at": "2026-03-02T10:30:00+00:00",
            "revoked_at": None,
        }
    ],
    "usage": {
        "source": "caches.selectors.tenant_usage",
        "limits": QUOTA_LIMITS,
        "caches": {"num_caches": 1, "capacity_bytes": CACHE_CAPACITY},
        "data_tokens_outstanding": 0,
        "resident_bytes": {"device": 6 * GIB, "dram": 11 * GIB, "ssd": 0, "network": 0},
    },
    "billing": {
        "available": True,
        "metered_usage": [
            {
                "period_start": "2026-03-02T10:00:00+00:00",
                "device_byte_seconds": 8 * GIB * 2700,
                "dram_byte_seconds": 32 * GIB * 2700,
                "ssd_byte_seconds": 0,
                "network_byte_seconds": 0,
                "device_gb_hours": "6.442450944",
                "dram_gb_hours": "25.769803776",
                "ssd_gb_hours": "0",
                "network_gb_hours": "0",
                "bytes_written": 3 * GIB,
                "tokens_served": 98_304,
            }
        ],
        "invoices": [],
    },
    "audit_events": [
        _exported_event(audit_examples.EVENT_ATTACHED),
        _exported_event(audit_examples.EVENT_READY),
    ],
}
EXPORT = OpenApiExample(
    "Tenant acme after attaching one cache",
    description="Abridged: the tenant's earlier audit events (its creation, its keys' issue) are left out.",
    value=ARCHIVE,
    response_only=True,
    status_codes=["200"],
)
EXPORT_SCOPES_MISSING = _error(
    "A key without every read scope",
    403,
    "permission_denied",
    "A data export needs the read scope of everything it contains.",
    required_scopes=["audit:read", "caches:read", "keys:read", "usage:read"],
    missing=["audit:read", "keys:read", "usage:read"],
)
