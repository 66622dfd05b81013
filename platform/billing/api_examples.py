"""Request and response examples for the usage, invoice and rate operations of the published reference."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

GIB = 2**30

USAGE = OpenApiExample(
    "One cache, within every limit",
    value={
        "tenant_id": "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b",
        "limits": {
            "max_caches": 10,
            "max_device_bytes": 64 * GIB,
            "max_dram_bytes": 256 * GIB,
            "max_ssd_bytes": 1024 * GIB,
            "max_network_bytes": 0,
            "max_requests_per_second": 50,
            "max_data_tokens_outstanding": 1000,
            "max_api_keys": 20,
        },
        "used": {
            "device_bytes": 8 * GIB,
            "dram_bytes": 32 * GIB,
            "ssd_bytes": 0,
            "network_bytes": 0,
            "caches": 1,
            "data_tokens_outstanding": 4,
            "api_keys": 2,
        },
        "resident": {"device_bytes": 6 * GIB, "dram_bytes": 11 * GIB, "ssd_bytes": 0, "network_bytes": 0},
        "over_quota": False,
        "over_quota_limits": [],
    },
    response_only=True,
    status_codes=["200"],
)

# ---- invoices: one 8 GiB device + 32 GiB DRAM cache for a 30-day month (GB = 10^9 bytes) ----------------------------

INVOICE = {
    "id": "a9b8c7d6-e5f4-4a3b-9c2d-1e0f9a8b7c6d",
    "tenant_id": "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b",
    "month": "2026-04",
    "status": "final",
    "currency": "USD",
    "subtotal": "371.0851743744",
    "total": "371.09",
    "generated_at": "2026-05-01T01:00:00Z",
    "finalised_at": "2026-05-03T00:00:00Z",
    "lines": [
        {
            "cache_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10",
            "meter": "device_gb_hour",
            "usage": 22265110462464000,
            "quantity": "6184.75290624",
            "unit_price": "0.04",
            "rate_effective_from": "2026-01-01T00:00:00Z",
            "amount": "247.3901162496",
        },
        {
            "cache_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10",
            "meter": "dram_gb_hour",
            "usage": 89060441849856000,
            "quantity": "24739.01162496",
            "unit_price": "0.005",
            "rate_effective_from": "2026-01-01T00:00:00Z",
            "amount": "123.6950581248",
        },
    ],
}
INVOICE_LIST = OpenApiExample(
    "One page of invoices",
    value={"count": 1, "next": None, "previous": None, "results": [INVOICE]},
    response_only=True,
    status_codes=["200"],
)
INVOICE_ONE = OpenApiExample("A final invoice", value=INVOICE, response_only=True, status_codes=["200"])

# ---- staff: the price list ---------------------------------------------------------------------------------------

RATE = {
    "id": 7,
    "meter": "device_gb_hour",
    "unit_price": "0.0400000000",
    "effective_from": "2026-01-01T00:00:00Z",
    "created_at": "2025-12-15T09:30:00Z",
}
RATE_LIST = OpenApiExample(
    "One page of rates",
    value={"count": 1, "next": None, "previous": None, "results": [RATE]},
    response_only=True,
    status_codes=["200"],
)
RATE_CREATE = OpenApiExample(
    "A new device price from May",
    value={"meter": "device_gb_hour", "unit_price": "0.035", "effective_from": "2026-05-01T00:00:00Z"},
    request_only=True,
)
RATE_CREATED = OpenApiExample(
    "Created",
    value={
        "id": 8,
        "meter": "device_gb_hour",
        "unit_price": "0.0350000000",
        "effective_from": "2026-05-01T00:00:00Z",
        "created_at": "2026-04-20T14:00:00Z",
    },
    response_only=True,
    status_codes=["201"],
)

# ---- node agents: node-7's fifth usage report since its restart at 14:30 (its one cache, fp16 Llama-3-8B) --------

USAGE_REPORT = OpenApiExample(
    "Absolute bytes per tier and counters since the agent's boot",
    value={
        "boot_id": "2c4e6a8b-0d1f-4a3c-9e5b-7d9f1b3d5f70",
        "sequence": 5,
        "sampled_at": "2026-03-02T14:35:00Z",
        "caches": [
            {
                "cache_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10",
                "device_bytes": 6 * GIB,
                "dram_bytes": 11 * GIB,
                "ssd_bytes": 0,
                "network_bytes": 0,
                "bytes_written_total": 3 * GIB,
                "tokens_served_total": 98_304,
            }
        ],
    },
    request_only=True,
)
USAGE_REPORT_ACK = OpenApiExample(
    "Recorded",
    value={"duplicate": False, "late": False, "accepted": 1, "refused": []},
    response_only=True,
    status_codes=["200"],
)
USAGE_REPORT_FROM_THE_FUTURE = OpenApiExample(
    "A node clock ten minutes ahead",
    value={
        "error": {
            "code": "invalid_usage_report",
            "message": "sampled_at is ahead of the control plane's clock by more than the allowed skew.",
            "details": {"sampled_at": "2026-03-02T14:45:00+00:00", "max_skew_seconds": 300},
        }
    },
    response_only=True,
    status_codes=["400"],
)
