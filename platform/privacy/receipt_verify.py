#!/usr/bin/env python3
"""Verify a KCaaS erasure receipt offline. Stand-alone: needs only the standard library and `cryptography`.

    python receipt_verify.py RECEIPT.json PLATFORM_KEY.json

RECEIPT.json is what GET /api/v1/admin/tenants/{id}/erasure/receipt returned:
    {"receipt": {...}, "signature": {"alg": "EdDSA", "key_id": "<kid>", "value": "<base64url>"}}
PLATFORM_KEY.json is the platform's public key as a JWK (GET /.well-known/kcaas-platform-key.json; an object with
"keys": [...] works too). The signature is Ed25519 over canonical(receipt): JSON with sorted keys, no whitespace,
UTF-8, no floats. Exit status 0 and "OK ..." when it verifies; 1 and the reason when it does not.
"""

from __future__ import annotations

import base64
import json
import sys

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

RECEIPT_TYPE = "kcaas.erasure-receipt"


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _public_key(jwk: dict, key_id: str) -> Ed25519PublicKey:
    keys = jwk.get("keys", [jwk])
    chosen = [k for k in keys if k.get("kid") == key_id] or keys[:1]
    key = chosen[0]
    if key.get("kty") != "OKP" or key.get("crv") != "Ed25519":
        raise ValueError("the platform key must be an Ed25519 (OKP) JWK")
    return Ed25519PublicKey.from_public_bytes(_b64url_decode(key["x"]))


def verify(envelope: dict, jwk: dict) -> dict:
    """The receipt body if the envelope's signature verifies under `jwk`; ValueError naming the problem otherwise."""
    receipt, signature = envelope.get("receipt"), envelope.get("signature") or {}
    if not isinstance(receipt, dict) or receipt.get("type") != RECEIPT_TYPE:
        raise ValueError("not a KCaaS erasure receipt")
    if signature.get("alg") != "EdDSA":
        raise ValueError("unsupported signature algorithm")
    try:
        _public_key(jwk, signature.get("key_id", "")).verify(_b64url_decode(signature["value"]), canonical(receipt))
    except (InvalidSignature, KeyError, ValueError) as error:
        raise ValueError(f"the signature does not verify ({type(error).__name__})") from None
    return receipt


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as receipt_file, open(argv[2], encoding="utf-8") as key_file:
        envelope, jwk = json.load(receipt_file), json.load(key_file)
    try:
        receipt = verify(envelope, jwk)
    except ValueError as error:
        print(f"FAILED: {error}")
        return 1
    print(f"OK erasure job {receipt.get('job_id')} completed {receipt.get('completed_at')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
