"""The Ed25519 key that signs data-plane tokens, and its public half as a JWKS.

Data-plane tokens are JWTs (RFC 7519) signed with EdDSA over Ed25519 (RFC 8037). The private key is
settings.KCAAS_TOKEN_SIGNING_KEY_PEM when set (production: from a secret store), else a PKCS#8 PEM file at
settings.KCAAS_TOKEN_SIGNING_KEY_FILE, created on first use with mode 0600 (audit.keys: created atomically, so two
processes starting together agree on one key). The key id (`kid`) is the RFC 7638 JWK thumbprint of the public key.

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
settings.KCAAS_DATA_TOKEN_TTL_SECONDS; a revoked jti is refused by the node (pushed on revocation and listed in
every register/heartbeat answer), and a detached or moved cache no longer matches the token's epoch.
"""

from functools import lru_cache

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings

from audit.keys import ed25519_private_key, public_jwk_of

ALGORITHM = "EdDSA"


def signing_key() -> Ed25519PrivateKey:
    return ed25519_private_key(settings.KCAAS_TOKEN_SIGNING_KEY_PEM, settings.KCAAS_TOKEN_SIGNING_KEY_FILE)


@lru_cache(maxsize=4)
def _public_jwk(pem_setting: str, file_setting: str) -> dict:
    return public_jwk_of(ed25519_private_key(pem_setting, file_setting).public_key(), alg=ALGORITHM)


def public_jwk() -> dict:
    """The signing key's public JWK (a fresh copy: callers may not change the cached one)."""
    return dict(_public_jwk(settings.KCAAS_TOKEN_SIGNING_KEY_PEM, settings.KCAAS_TOKEN_SIGNING_KEY_FILE))


def jwks() -> dict:
    return {"keys": [public_jwk()]}


def token_sign(claims: dict) -> str:
    return jwt.encode(claims, signing_key(), algorithm=ALGORITHM, headers={"kid": public_jwk()["kid"], "typ": "JWT"})
