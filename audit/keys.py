"""Ed25519 keys of the platform: loading (a PEM from a setting, else a 0600 file created once, atomically) and the
platform signing key, which signs audit digests and erasure receipts so they verify offline.

The platform key is settings.KCAAS_PLATFORM_SIGNING_KEY_PEM when set (production: from a secret store), else the
PKCS#8 PEM file settings.KCAAS_PLATFORM_SIGNING_KEY_FILE (dev default under var/secrets). Its public half is
published as a JWK (`platform_public_jwk`, served at /.well-known/kcaas-platform-key.json); `key_id` is the RFC 7638
thumbprint. The data-token key (caches.signing) is a different key loaded the same way.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.conf import settings


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_ed25519_pem() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_or_create_private_file(path: Path, generate: Callable[[], bytes] = _new_ed25519_pem) -> bytes:
    """The bytes of the 0600 file `path`, created once with `generate()` when missing. Concurrent creators (threads
    or processes) all end up reading the one file that won: the others' keys are discarded, never used."""
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = generate()
    # Write a complete 0600 temporary file, then link it into place: link fails if another process won the race,
    # and then its key is the one everybody uses.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return path.read_bytes()


_load_or_create_file = load_or_create_private_file  # the Ed25519 default, as the audit and token keys use it


@lru_cache(maxsize=8)
def ed25519_private_key(pem_setting: str, file_setting: str) -> Ed25519PrivateKey:
    """The key from a PEM string, else from (or created at) a file path."""
    pem = pem_setting.encode() if pem_setting else _load_or_create_file(Path(file_setting))
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the key must be an Ed25519 private key")
    return key


def public_jwk_of(public_key: Ed25519PublicKey, *, alg: str = "EdDSA") -> dict:
    """The OKP/Ed25519 JWK of a public key, with its RFC 7638 thumbprint as `kid`."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    members = {"crv": "Ed25519", "kty": "OKP", "x": b64url(raw)}  # RFC 7638: required members, sorted, no spaces
    thumbprint = b64url(hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest())
    return {**members, "kid": thumbprint, "use": "sig", "alg": alg}


def platform_key() -> Ed25519PrivateKey:
    return ed25519_private_key(settings.KCAAS_PLATFORM_SIGNING_KEY_PEM, settings.KCAAS_PLATFORM_SIGNING_KEY_FILE)


def platform_public_jwk() -> dict:
    return public_jwk_of(platform_key().public_key())


def platform_sign(payload: bytes) -> tuple[str, str]:
    """(key id, base64url signature) of `payload` under the platform key."""
    return platform_public_jwk()["kid"], b64url(platform_key().sign(payload))
