"""The Ed25519 key that signs data-plane tokens, and its public half as a JWKS.

Data-plane tokens are JWTs (RFC 7519) signed with EdDSA over Ed25519 (RFC 8037). The private key is
settings.KCAAS_TOKEN_SIGNING_KEY_PEM when set (production: from a secret store), else a PKCS#8 PEM file at
settings.KCAAS_TOKEN_SIGNING_KEY_FILE, created on first use with mode 0600 (created atomically, so two processes
starting together agree on one key). The key id (`kid`) is the RFC 7638 JWK thumbprint of the public key.

How a node verifies a token offline
-----------------------------------
The node fetches `GET /.well-known/jwks.json` once at start (and again when it meets an unknown `kid`), then for
each data-plane request, with no call to the control plane::

    key = jwt.PyJWK(jwk_whose_kid_matches(jwt.get_unverified_header(token)["kid"]))
    claims = jwt.decode(
        token, key.key, algorithms=["EdDSA"],           # never take the algorithm from the token
        audience=f"cache:{cache_id}",                    # a cache this node hosts, the one the request names
        issuer=KCAAS_TOKEN_ISSUER,
        options={"require": ["exp", "iat", "nbf", "aud", "iss", "sub", "jti"]},
        leeway=5,                                        # seconds of clock skew tolerated
    )
    then require claims["node"] == own node id and claims["epoch"] == the epoch it holds the cache at
    (a token minted before a migration does not work on the old node), and claims["access"] == "readwrite"
    for put/delete ("read" allows lookup/get only).

PyJWT checks the signature, exp, nbf, iss and aud. A token is valid for at most
settings.KCAAS_DATA_TOKEN_TTL_SECONDS; revocation on the control plane (detach) is enforced by the node through
the epoch and the cache's detachment, not by a revocation list.
"""

import base64
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.conf import settings

ALGORITHM = "EdDSA"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _load_or_create_file(path: Path) -> bytes:
    if path.exists():
        return path.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Write a complete 0600 temporary file, then link it into place: link fails if another process won the race,
    # and then its key is the one everybody uses.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".token-key-")
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


@lru_cache(maxsize=4)
def _signing_key(pem_setting: str, file_setting: str) -> Ed25519PrivateKey:
    pem = pem_setting.encode() if pem_setting else _load_or_create_file(Path(file_setting))
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the data-token signing key must be an Ed25519 private key")
    return key


def signing_key() -> Ed25519PrivateKey:
    return _signing_key(settings.KCAAS_TOKEN_SIGNING_KEY_PEM, settings.KCAAS_TOKEN_SIGNING_KEY_FILE)


def public_jwk_of(public_key: Ed25519PublicKey) -> dict:
    """The OKP/Ed25519 JWK of a public key, with its RFC 7638 thumbprint as `kid`."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    members = {"crv": "Ed25519", "kty": "OKP", "x": _b64url(raw)}  # RFC 7638: required members, sorted, no spaces
    thumbprint = _b64url(hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest())
    return {**members, "kid": thumbprint, "use": "sig", "alg": ALGORITHM}


@lru_cache(maxsize=4)
def _public_jwk(pem_setting: str, file_setting: str) -> dict:
    return public_jwk_of(_signing_key(pem_setting, file_setting).public_key())


def public_jwk() -> dict:
    """The signing key's public JWK (a fresh copy: callers may not change the cached one)."""
    return dict(_public_jwk(settings.KCAAS_TOKEN_SIGNING_KEY_PEM, settings.KCAAS_TOKEN_SIGNING_KEY_FILE))


def jwks() -> dict:
    return {"keys": [public_jwk()]}


def token_sign(claims: dict) -> str:
    return jwt.encode(claims, signing_key(), algorithm=ALGORITHM, headers={"kid": public_jwk()["kid"], "typ": "JWT"})
