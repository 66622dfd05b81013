"""The audit trail's hash chain, in one file that needs only the standard library (and `cryptography` for digest
signatures), so a compliance team can verify an export with this file alone.

An event is hashed over a canonical encoding of its non-personal fields plus *commitments* to its personal ones:

    commitment(f) = sha256(salt || f || 0x00 || canonical(value of f))            (hex; salt: 16 random bytes)
    hash          = sha256(prev_hash (32 raw bytes) || canonical({NON_PERSONAL fields..., "commitments": {...}}))

so pseudonymising an erased tenant (replacing its personal fields and wiping the salt) leaves every hash, and so the
chain, intact: the commitments still bind what was there, and without the salt they reveal nothing of it.
canonical(x) = JSON with sorted keys, no whitespace, UTF-8, integers and strings only (no floats).
The first event's prev_hash is GENESIS_HASH. A verifier recomputes each event's commitments (when its salt is still
there), its hash, and the link to the previous event: a changed, deleted, inserted or reordered event breaks it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

GENESIS_HASH = "0" * 64
PERSONAL_FIELDS = ("actor_id", "tenant_id", "source_ip", "target_id", "old_values", "new_values")
NON_PERSONAL_FIELDS = ("seq", "occurred_at", "actor_kind", "action", "target_type", "request_id")


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def commitment(salt: bytes, field: str, value: Any) -> str:
    return hashlib.sha256(salt + field.encode() + b"\x00" + canonical(value)).hexdigest()


def commitments_of(salt: bytes, event: dict) -> dict[str, str]:
    return {field: commitment(salt, field, event.get(field)) for field in PERSONAL_FIELDS}


def event_hash(prev_hash: str, event: dict, commitments: dict[str, str]) -> str:
    body = {field: event[field] for field in NON_PERSONAL_FIELDS}
    body["commitments"] = commitments
    return hashlib.sha256(bytes.fromhex(prev_hash) + canonical(body)).hexdigest()
