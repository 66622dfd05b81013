"""Response examples for the tenant's usage operation of the published reference."""

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
