"""Request and response examples for the audit room's operations of the published reference.

Every value is true of one example trail, signed by an example platform key (PLATFORM_KEY: its private half is the
sha256 of EXAMPLE_KEY_LABEL, so anyone can sign more examples with it; tests/controlplane/test_api_reference.py
checks that and verifies each signature): tenant acme's cache `llama3-8b-chat` attached by its key
`q7Hc2LkPx4Rt9Wm2` (event 1041) and made ready (1043), another tenant's event between them (1042), and the two
hourly digests around them. The export example is that tenant's export of 10:00-11:00, JSONL and CSV:
`python audit/chain.py verify` accepts it.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from drf_spectacular.utils import OpenApiExample

from audit import chain

TENANT_ID = "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b"
CACHE_ID = "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10"
NODE_ID = "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f"
KEY_PUBLIC_ID = "q7Hc2LkPx4Rt9Wm2"
EXAMPLE_KEY_LABEL = "kcaas reference example platform key"  # Ed25519 private key: sha256 of this, never a real one

JWK = {
    "crv": "Ed25519",
    "kty": "OKP",
    "x": "zC-RNaQGlqnTmziJyBgUtDm4d1wRm_fltdA9YlJdQW0",
    "kid": "2McR6VXntRHcY9gTaONoe4rdaC2O_oM52NtjoZ62GQc",
    "use": "sig",
    "alg": "EdDSA",
}
PLATFORM_KEY = OpenApiExample("The platform key", value=JWK, response_only=True, status_codes=["200"])

# ---- the trail: events 1041 (acme's), 1042 (another tenant's: a witness in acme's export), 1043 (acme's) ------------

SPEC = {
    "attention": "mha",
    "block_size": 16,
    "head_dim": 128,
    "kv_dtype": "float16",
    "kv_lora_rank": 0,
    "model_fingerprint": "meta-llama/Meta-Llama-3-8B@main",
    "num_kv_heads": 8,
    "num_layers": 32,
    "qk_rope_head_dim": 0,
    "storage_dtype": "float16",
}
EVENT_ATTACHED: dict[str, Any] = {
    "action": 3001,
    "action_name": "cache.attached",
    "actor_id": "q7Hc2LkPx4Rt9Wm2",
    "actor_kind": "key",
    "commitments": {
        "actor_id": "693c7512af9c2428fe443c6f183dd48350d1984bcf935719970282d8b1d3015c",
        "new_values": "4b9f8716bd0802740d954cc79f22e9eb8438d4244fb440cb77c9703e3fc7e67c",
        "old_values": "6cff07cb798a218ed6469e069b6bba9f8e70f81393e293c7ad116e9105c798d9",
        "source_ip": "91d6049d60eecb7b920e1e215e090a3c515dd62b99aa04a599f02fa6e3b17e35",
        "target_id": "75da5b9e7bb13e5b44c4cea8ef02720a0cae7d0413fc8fd584c0167fa8b97a92",
        "tenant_id": "e49840ad018a23bec8a43aaf06a50069b7b53586b13f2284e9c34843e314bf51",
    },
    "hash": "ed5bb9f5c68ed97b6ad17aed6fb5f58d874163b7df8ecfd52f7d2225d4aef493",
    "new_values": {
        "capacity": {"device": 8589934592, "dram": 34359738368, "network": 0, "ssd": 0},
        "epoch": 1,
        "name": "llama3-8b-chat",
        "network_write_through": False,
        "node_id": "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f",
        "spec": {
            "attention": "mha",
            "block_size": 16,
            "head_dim": 128,
            "kv_dtype": "float16",
            "kv_lora_rank": 0,
            "model_fingerprint": "meta-llama/Meta-Llama-3-8B@main",
            "num_kv_heads": 8,
            "num_layers": 32,
            "qk_rope_head_dim": 0,
            "storage_dtype": "float16",
        },
        "state": "provisioning",
    },
    "occurred_at": "2026-03-02T10:15:00.214805+00:00",
    "old_values": None,
    "prev_hash": "c02e6d86774e93437556b7737b6896dbff99cebb21d789a45afa6e3287472e83",
    "record_type": "event",
    "request_id": "3f9c2e7a1b4d4e8f9a6c5b0d2e1f7a84",
    "salt": "2a2839e7db3c5ae1d57d5e83ed4acecf",
    "seq": 1041,
    "source_ip": "203.0.113.24",
    "target_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10",
    "target_type": "cache",
    "tenant_id": "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b",
}
EVENT_WITNESS: dict[str, Any] = {
    "hash": "5ae605341c12cc5d2c3c5fc52664f3e6cc57b2d91d9c62c43acef29ac465101e",
    "prev_hash": "ed5bb9f5c68ed97b6ad17aed6fb5f58d874163b7df8ecfd52f7d2225d4aef493",
    "record_type": "witness",
    "seq": 1042,
}
EVENT_READY: dict[str, Any] = {
    "action": 3002,
    "action_name": "cache.ready",
    "actor_id": "",
    "actor_kind": "system",
    "commitments": {
        "actor_id": "4a7cba60406472fd5c87947d2767cdc4d538445fd6a9df66d879faba6e1f1f8c",
        "new_values": "ae74d0a30a495e17034a92a4897696a61bde0f51031d204190aa431535ecf4a9",
        "old_values": "795cf6bb8ffaa3a8e57d04ef2a13621eaf7b231aab037d437f1db81d3a8067b2",
        "source_ip": "4b03598c26cc613e79ea98ac5a127378c9e02e8f1cc58a2332c2b9f8727d5661",
        "target_id": "62bda0a6a56b47f2afc6e31a6240bc659933abc6f956b9ad711439991c4d23fd",
        "tenant_id": "f6a2cc84ade52e36d70174c3838068158544db9556cacdfad72ce3b40be34c57",
    },
    "hash": "526ba96408373f372820acf39029b1169f771f4fa81180ba92d90e30096b0000",
    "new_values": {"epoch": 1, "state": "ready"},
    "occurred_at": "2026-03-02T10:15:04.118342+00:00",
    "old_values": {"state": "provisioning"},
    "prev_hash": "5ae605341c12cc5d2c3c5fc52664f3e6cc57b2d91d9c62c43acef29ac465101e",
    "record_type": "event",
    "request_id": "",
    "salt": "3bf697966727292c8aa77f515769ebdd",
    "seq": 1043,
    "source_ip": None,
    "target_id": "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10",
    "target_type": "cache",
    "tenant_id": "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b",
}
DIGEST_09: dict[str, Any] = {
    "digest_hash": "798c50e711d04a2c98ef7e1ad982315ccf97c6011c4535288ae227d85b7544d3",
    "head_hash": "c02e6d86774e93437556b7737b6896dbff99cebb21d789a45afa6e3287472e83",
    "head_seq": 1040,
    "key_id": "2McR6VXntRHcY9gTaONoe4rdaC2O_oM52NtjoZ62GQc",
    "period_end": "2026-03-02T10:00:00Z",
    "period_start": "2026-03-02T09:00:00Z",
    "prev_digest_hash": "a14733f0182d4f287a197c79eecaa843b96c207074513cf9baae84766736e3e1",
    "record_type": "digest",
    "signature": "UBG3ypxYTSXJGx2e-WDIclVxWp0WUdBFXlFYeMqMFERFJxmnPuHAbTORleW5QdW_aZHbvtYj5-iNUx4XU9t7DQ",
}
DIGEST_10: dict[str, Any] = {
    "digest_hash": "7ff645d551969d074532807494289b715c44c5b847910098d2ce102ac70c33c1",
    "head_hash": "526ba96408373f372820acf39029b1169f771f4fa81180ba92d90e30096b0000",
    "head_seq": 1043,
    "key_id": "2McR6VXntRHcY9gTaONoe4rdaC2O_oM52NtjoZ62GQc",
    "period_end": "2026-03-02T11:00:00Z",
    "period_start": "2026-03-02T10:00:00Z",
    "prev_digest_hash": "798c50e711d04a2c98ef7e1ad982315ccf97c6011c4535288ae227d85b7544d3",
    "record_type": "digest",
    "signature": "cItn-KVb--_cyVN68pCFgxvQr5ZPW-Mdv0GonH1l7j7KKT08C3HnpvorNRYcKxdpbF9N4Z1Vah-DznCrxEAMCQ",
}


def _api_event(record: dict) -> dict:
    """An export's event record as GET /api/v1/audit/events shows it (times in Z, no salt or commitments)."""
    fields = ("seq", "occurred_at", "actor_kind", "actor_id", "tenant_id", "action", "action_name", "target_type")
    event = {name: record[name] for name in fields}
    event["occurred_at"] = record["occurred_at"].replace("+00:00", "Z")
    for name in ("target_id", "request_id", "source_ip", "old_values", "new_values", "prev_hash", "hash"):
        event[name] = record[name]
    return {**event, "pseudonymised": False}


# a list's example is one item: drf-spectacular wraps it in the page (controlplane.openapi fills the page's links)
EVENT_LIST = OpenApiExample(
    "A cache attached by a tenant key",
    value=_api_event(EVENT_ATTACHED),
    response_only=True,
    status_codes=["200"],
)
DIGEST_LIST = OpenApiExample(
    "The 10:00-11:00 digest",
    value={name: value for name, value in DIGEST_10.items() if name != "record_type"},
    response_only=True,
    status_codes=["200"],
)

# ---- the tenant's export of [10:00, 11:00) -------------------------------------------------------------------------

EXPORT_HEADER: dict[str, Any] = {
    "counts": {"digest": 2, "event": 2, "witness": 1},
    "digest_period_seconds": 3600,
    "filter": {"tenant_id": "0b7e9f4a-1c2d-4e3f-8a5b-6c7d8e9f0a1b"},
    "first_seq": 1041,
    "format": "kcaas-audit-export",
    "generated_at": "2026-03-02T11:05:12.480311+00:00",
    "last_seq": 1043,
    "platform_key": {
        "alg": "EdDSA",
        "crv": "Ed25519",
        "kid": "2McR6VXntRHcY9gTaONoe4rdaC2O_oM52NtjoZ62GQc",
        "kty": "OKP",
        "use": "sig",
        "x": "zC-RNaQGlqnTmziJyBgUtDm4d1wRm_fltdA9YlJdQW0",
    },
    "range": {"from": "2026-03-02T10:00:00+00:00", "to": "2026-03-02T11:00:00+00:00"},
    "record_type": "header",
    "version": 2,
}
EXPORT_SIGNATURE: dict[str, Any] = {
    "key_id": "2McR6VXntRHcY9gTaONoe4rdaC2O_oM52NtjoZ62GQc",
    "record_type": "signature",
    "records_hash": "d117b0a15e1ac3849e1dcd77bade5bc6feb652658a045d0780dc80b4d30cf605",
    "signature": "wNSjQ1oeejZ6icE-gJxfZP8RuhVfOUxBIpKOLLX0PC850VUSh5GIcdG-g044f3CQnryvvubg3iBKBQqtnh1uDQ",
}
EXPORT_RECORDS: list[dict[str, Any]] = [
    EXPORT_HEADER,
    EVENT_ATTACHED,
    EVENT_WITNESS,
    EVENT_READY,
    DIGEST_09,
    DIGEST_10,
    EXPORT_SIGNATURE,
]
EXPORT_JSONL = "".join(chain.canonical(record).decode() + "\n" for record in EXPORT_RECORDS)


def _csv(records: list[dict]) -> str:
    """The CSV form of the same records, as audit.exports writes it."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(chain.CSV_COLUMNS)
    for record in records:
        writer.writerow(chain.csv_row(record))
    return buffer.getvalue()


EXPORT_CSV = _csv(EXPORT_RECORDS)
EXPORT_QUERY = "format=jsonl&from=2026-03-02T10:00:00Z&to=2026-03-02T11:00:00Z"
AUDIT_EXPORT_JSONL = OpenApiExample(
    "Tenant acme, 10:00-11:00 (JSONL)",
    value=EXPORT_JSONL,
    response_only=True,
    status_codes=["200"],
    media_type="application/x-ndjson",
)
AUDIT_EXPORT_CSV = OpenApiExample(
    "Tenant acme, 10:00-11:00 (CSV)",
    value=EXPORT_CSV,
    response_only=True,
    status_codes=["200"],
    media_type="text/csv",
)

# ---- refusals -------------------------------------------------------------------------------------------------------

INVALID_RANGE = OpenApiExample(
    "from is not before to",
    value={"error": {"code": "invalid_range", "message": "`from` must be before `to`.", "details": {}}},
    response_only=True,
    status_codes=["400"],
)
SCOPE_MISSING = OpenApiExample(
    "A key without audit:read",
    value={
        "error": {
            "code": "permission_denied",
            "message": "This key lacks the audit:read scope.",
            "details": {"required_scope": "audit:read"},
        }
    },
    response_only=True,
    status_codes=["403"],
)
