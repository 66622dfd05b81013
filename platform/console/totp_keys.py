"""Sealing the console's TOTP seeds at rest under the platform's key-encryption key (KCAAS_KEK), as the caches room
seals hash keys (caches/sealing.py) and the tenants room wraps tenant keys (tenants/tenant_keys.py):

    sealed = version (1 byte, 0x01) || nonce (12 random bytes) || AES-256-GCM(key, nonce, seed, aad)
    key    = HKDF-SHA256(KCAAS_KEK, info = "kcaas/console/totp-key/v1")   (a key of its own: another label)
    aad    = "kcaas-console-totp:" || the user's primary key

The user id as associated data binds a seed to its owner: a sealed seed copied onto another user's device does not
open. The database (and a dump or a backup of it) never holds a seed in clear; whoever holds the KEK can open them.
Imported by the console's model and by its data migration, so both seal the same way.
"""

from __future__ import annotations

import os
from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

VERSION = b"\x01"
NONCE_BYTES = 12
SEED_BYTES = 20  # django-otp's default: 160 bits, what authenticator apps expect for SHA-1 TOTP
_HKDF_INFO = b"kcaas/console/totp-key/v1"


class TotpKeyError(Exception):
    """A sealed seed that does not open: the wrong KEK, another user's row, or altered bytes."""


@lru_cache(maxsize=4)
def _aead(kek: str) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(kek.encode()))


def _aad(user_id) -> bytes:
    return b"kcaas-console-totp:" + str(user_id).encode()


def totp_key_seal(*, user_id, seed: bytes) -> bytes:
    if not seed:
        raise ValueError("an empty TOTP seed")
    nonce = os.urandom(NONCE_BYTES)
    return VERSION + nonce + _aead(settings.KCAAS_KEK).encrypt(nonce, seed, _aad(user_id))


def totp_key_unseal(*, user_id, sealed: bytes) -> bytes:
    sealed = bytes(sealed or b"")
    if len(sealed) <= 1 + NONCE_BYTES or sealed[:1] != VERSION:
        raise TotpKeyError("not a sealed TOTP seed")
    try:
        return _aead(settings.KCAAS_KEK).decrypt(sealed[1 : 1 + NONCE_BYTES], sealed[1 + NONCE_BYTES :], _aad(user_id))
    except Exception as exc:  # InvalidTag
        raise TotpKeyError("the TOTP seed does not open (wrong KEK, another user's row, or altered)") from exc


def new_sealed_seed(*, user_id) -> bytes:
    return totp_key_seal(user_id=user_id, seed=os.urandom(SEED_BYTES))
