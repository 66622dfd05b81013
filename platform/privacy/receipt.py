"""The signed deletion receipt of a completed erasure.

The receipt is canonical JSON (privacy.receipt_verify.canonical: sorted keys, no whitespace, UTF-8, integers and
strings only) listing what was erased where and when; the envelope adds an Ed25519 signature by the platform key
(audit.keys.platform_sign) over exactly those bytes, so anyone holding the published platform key can check it
offline with privacy/receipt_verify.py alone.
"""

from __future__ import annotations

from audit.keys import platform_public_jwk, platform_sign
from privacy.models import ErasureJob
from privacy.receipt_verify import RECEIPT_TYPE, canonical, verify

RECEIPT_VERSION = 1


def receipt_sign(body: dict) -> tuple[str, str]:
    """(key id, base64url Ed25519 signature) of the canonical receipt body."""
    return platform_sign(canonical(body))


def receipt_envelope(job: ErasureJob) -> dict:
    """What GET .../erasure/receipt answers and receipt_verify.py checks."""
    return {
        "receipt": job.receipt,
        "signature": {"alg": "EdDSA", "key_id": job.receipt_key_id, "value": job.receipt_signature},
    }


def receipt_verify(envelope: dict) -> dict:
    """The receipt body if it verifies under this platform's current key; ValueError otherwise."""
    return verify(envelope, platform_public_jwk())


def iso(value) -> str | None:
    return value.isoformat() if value is not None else None


__all__ = ["RECEIPT_TYPE", "RECEIPT_VERSION", "canonical", "iso", "receipt_envelope", "receipt_sign", "receipt_verify"]
