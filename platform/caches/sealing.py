"""Sealing the per-cache block-hash key under the control plane's key-encryption key (KEK).

Each cache has a 32-byte secret that keys the chained block hashes on its node (DESIGN.md §3.4): the client never
chooses it, so two tenants' identical prompts never share a block or a hash. The control plane keeps it sealed:

    sealed = version (1 byte, 0x01) || nonce (12 random bytes) || AES-256-GCM(kek, nonce, key, aad=cache id)

The AES key is derived from settings.KCAAS_KEK (any high-entropy string) with HKDF-SHA256 and a fixed label, so the
setting's format does not matter. The cache id as associated data binds a sealed key to its row: copied onto
another cache it fails to open instead of silently giving that cache someone else's hash key.

Since issue 5 (crypto-shredding), a cache's hash key is sealed under its TENANT's data key instead
(tenants.tenant_keys, format version 0x02, same associated data): destroying the tenant key at erasure makes every
such blob unopenable. Version 0x01 (KEK) blobs of older caches still open; erasure also blanks the sealed column
of the erased tenant's cache rows, so neither version survives an erasure. `hash_key_new_sealed` without a tenant
(tests, tools) still writes version 0x01.
"""

import os
import uuid
from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from tenants.tenant_keys import (
    TenantKeyDestroyed,
    TenantSealError,
    is_tenant_sealed,
    tenant_seal,
    tenant_unseal,
)

HASH_KEY_NUM_BYTES = 32
_VERSION = b"\x01"
_NONCE_NUM_BYTES = 12
_HKDF_INFO = b"kcaas/caches/hash-key-kek/v1"


class SealError(Exception):
    """A sealed key that does not open: wrong KEK, another cache's row, altered bytes, or a destroyed tenant key."""


class HashKeyShredded(SealError):
    """The cache's tenant key was destroyed (erasure): its hash key is gone for good."""


@lru_cache(maxsize=4)
def _aead(kek: str) -> AESGCM:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(kek.encode())
    return AESGCM(key)


def _aad(cache_id: uuid.UUID | str) -> bytes:
    return b"kcaas-cache:" + str(uuid.UUID(str(cache_id))).encode()


def hash_key_seal(*, cache_id: uuid.UUID | str, hash_key: bytes) -> bytes:
    if len(hash_key) != HASH_KEY_NUM_BYTES:
        raise ValueError(f"a cache hash key is {HASH_KEY_NUM_BYTES} bytes")
    nonce = os.urandom(_NONCE_NUM_BYTES)
    return _VERSION + nonce + _aead(settings.KCAAS_KEK).encrypt(nonce, hash_key, _aad(cache_id))


def hash_key_new_sealed(*, cache_id: uuid.UUID | str, tenant_id: uuid.UUID | str | None = None) -> bytes:
    """A fresh random hash key for `cache_id`, sealed under the tenant's data key (version 0x02; without a tenant:
    under the KEK, version 0x01); the plaintext is not kept."""
    hash_key = os.urandom(HASH_KEY_NUM_BYTES)
    if tenant_id is None:
        return hash_key_seal(cache_id=cache_id, hash_key=hash_key)
    return tenant_seal(tenant_id=tenant_id, plaintext=hash_key, aad=_aad(cache_id))


def _ssd_aad(cache_id: uuid.UUID | str) -> bytes:
    return b"kcaas-cache-ssd:" + str(uuid.UUID(str(cache_id))).encode()


def ssd_key_new_sealed(*, cache_id: uuid.UUID | str, tenant_id: uuid.UUID | str) -> bytes:
    """A fresh random SSD data key for `cache_id` (AES-256-GCM key of the node's SSD tier), sealed under the tenant's
    data key with its own associated data (a sealed hash key does not open as an SSD key, nor the reverse)."""
    return tenant_seal(tenant_id=tenant_id, plaintext=os.urandom(HASH_KEY_NUM_BYTES), aad=_ssd_aad(cache_id))


def ssd_key_unseal(*, cache_id: uuid.UUID | str, sealed: bytes) -> bytes:
    """The plaintext SSD data key. HashKeyShredded once the tenant key is destroyed (erasure): after that, whatever
    a node still has on disk for the cache is unreadable."""
    try:
        return tenant_unseal(sealed=bytes(sealed), aad=_ssd_aad(cache_id))
    except TenantKeyDestroyed as exc:
        raise HashKeyShredded("the tenant's data key was destroyed") from exc
    except TenantSealError as exc:
        raise SealError("the sealed SSD key does not open for this cache") from exc


def hash_key_unseal(*, cache_id: uuid.UUID | str, sealed: bytes) -> bytes:
    """The plaintext hash key of either version. HashKeyShredded once the tenant key is destroyed."""
    sealed = bytes(sealed)
    if is_tenant_sealed(sealed):
        try:
            return tenant_unseal(sealed=sealed, aad=_aad(cache_id))
        except TenantKeyDestroyed as exc:
            raise HashKeyShredded("the tenant's data key was destroyed") from exc
        except TenantSealError as exc:
            raise SealError("the sealed hash key does not open for this cache") from exc
    if len(sealed) < 1 + _NONCE_NUM_BYTES or sealed[:1] != _VERSION:
        raise SealError("unknown sealed-key format")
    nonce, ciphertext = sealed[1 : 1 + _NONCE_NUM_BYTES], sealed[1 + _NONCE_NUM_BYTES :]
    try:
        return _aead(settings.KCAAS_KEK).decrypt(nonce, ciphertext, _aad(cache_id))
    except Exception as exc:  # cryptography raises InvalidTag; anything else is just as much a failure to open
        raise SealError("the sealed hash key does not open for this cache") from exc
