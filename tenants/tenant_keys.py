"""Per-tenant data keys and sealing under them: the root of crypto-shredding (DESIGN.md §3.9).

Each tenant has one data key (tenants.models.TenantKey): 32 random bytes, wrapped under settings.KCAAS_KEK

    wrapped = 0x01 || nonce (12) || AES-256-GCM(HKDF(KEK, "kcaas/tenants/tenant-key-kek/v1"), nonce, key,
                                              aad = "kcaas-tenant-key:" || tenant id || ":" || key id)

and secrets of the tenant (caches' hash keys; issue 6's SSD data keys) are sealed under it:

    sealed = 0x02 || len(key id) (1 byte) || key id (ASCII) || nonce (12) || AES-256-GCM(data key, nonce, secret,
                                              aad = "kcaas-tenant-seal:" || key id || ":" || caller's aad)

The caller's associated data binds a blob to its row (e.g. the cache id), so a blob copied elsewhere does not open.
Invariants:
- a tenant's key is created lazily, once (concurrent first uses agree on one row), and never replaced;
- `tenant_key_destroy` erases the wrapped key; from then on every blob sealed under it raises TenantKeyDestroyed
  and no new blob can be sealed for that tenant (there is no way back: the plaintext key was never stored);
- the plaintext data key lives only inside one call (unwrapped per call, never cached), so destruction takes effect
  at once in every process.
"""

from __future__ import annotations

import os
import secrets
import uuid
from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tenants.models import TenantKey

DATA_KEY_NUM_BYTES = 32
NONCE_NUM_BYTES = 12
WRAP_VERSION = b"\x01"
SEAL_VERSION = b"\x02"
_HKDF_INFO = b"kcaas/tenants/tenant-key-kek/v1"


class TenantSealError(Exception):
    """A blob that does not open: altered bytes, another row's associated data, another tenant, or the wrong KEK."""


class TenantKeyDestroyed(TenantSealError):
    """The tenant's data key was destroyed (crypto-shredded): nothing sealed under it opens, nothing new is sealed."""


@lru_cache(maxsize=4)
def _kek_aead(kek: str) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO).derive(kek.encode()))


def _wrap_aad(tenant_id, key_id: str) -> bytes:
    return f"kcaas-tenant-key:{uuid.UUID(str(tenant_id))}:{key_id}".encode()


def _seal_aad(key_id: str, aad: bytes) -> bytes:
    return b"kcaas-tenant-seal:" + key_id.encode() + b":" + bytes(aad)


def _new_key_row(tenant_id) -> TenantKey:
    key_id = "tk_" + secrets.token_hex(12)
    nonce = os.urandom(NONCE_NUM_BYTES)
    wrapped = (
        WRAP_VERSION
        + nonce
        + _kek_aead(settings.KCAAS_KEK).encrypt(nonce, os.urandom(DATA_KEY_NUM_BYTES), _wrap_aad(tenant_id, key_id))
    )
    return TenantKey(tenant_id=tenant_id, key_id=key_id, wrapped_key=wrapped)


def tenant_key_ensure(*, tenant_id) -> TenantKey:
    """The tenant's key row, created on first use. Concurrent callers get the same row (the insert that loses the
    race on the primary key is ignored). A destroyed key is returned as it is, never replaced."""
    TenantKey.objects.bulk_create([_new_key_row(tenant_id)], ignore_conflicts=True)
    return TenantKey.objects.get(tenant_id=tenant_id)


def _unwrap(row: TenantKey) -> bytes:
    if row.wrapped_key is None:
        raise TenantKeyDestroyed(f"the data key {row.key_id} was destroyed")
    wrapped = bytes(row.wrapped_key)
    if wrapped[:1] != WRAP_VERSION or len(wrapped) < 1 + NONCE_NUM_BYTES:
        raise TenantSealError("unknown wrapped-key format")
    nonce, body = wrapped[1 : 1 + NONCE_NUM_BYTES], wrapped[1 + NONCE_NUM_BYTES :]
    try:
        return _kek_aead(settings.KCAAS_KEK).decrypt(nonce, body, _wrap_aad(row.tenant_id, row.key_id))
    except Exception as exc:  # InvalidTag: the wrong KEK or an altered row
        raise TenantSealError("the tenant's data key does not unwrap under this KEK") from exc


def tenant_seal(*, tenant_id, plaintext: bytes, aad: bytes) -> bytes:
    """`plaintext` sealed under the tenant's data key (created if needed), bound to `aad`."""
    row = tenant_key_ensure(tenant_id=tenant_id)
    data_key = _unwrap(row)
    nonce = os.urandom(NONCE_NUM_BYTES)
    key_id = row.key_id.encode()
    ciphertext = AESGCM(data_key).encrypt(nonce, bytes(plaintext), _seal_aad(row.key_id, aad))
    return SEAL_VERSION + bytes([len(key_id)]) + key_id + nonce + ciphertext


def is_tenant_sealed(sealed: bytes) -> bool:
    return bytes(sealed[:1]) == SEAL_VERSION


def sealed_key_id(sealed: bytes) -> str:
    """The key id a blob names (TenantSealError when it is not a tenant-sealed blob)."""
    sealed = bytes(sealed)
    if not is_tenant_sealed(sealed) or len(sealed) < 2 or len(sealed) < 2 + sealed[1] + NONCE_NUM_BYTES:
        raise TenantSealError("not a tenant-sealed blob")
    return sealed[2 : 2 + sealed[1]].decode("ascii", errors="replace")


def tenant_unseal(*, sealed: bytes, aad: bytes, tenant_id=None) -> bytes:
    """Open a blob sealed by `tenant_seal` with the same `aad`. With `tenant_id`, the blob must be that tenant's.
    Raises TenantKeyDestroyed after crypto-shredding, TenantSealError for anything else that does not open."""
    sealed = bytes(sealed)
    key_id = sealed_key_id(sealed)
    row = TenantKey.objects.filter(key_id=key_id).first()
    if row is None or (tenant_id is not None and str(row.tenant_id) != str(uuid.UUID(str(tenant_id)))):
        raise TenantSealError("the blob names no data key of this tenant")
    data_key = _unwrap(row)
    start = 2 + sealed[1]
    nonce, ciphertext = sealed[start : start + NONCE_NUM_BYTES], sealed[start + NONCE_NUM_BYTES :]
    try:
        return AESGCM(data_key).decrypt(nonce, ciphertext, _seal_aad(key_id, aad))
    except Exception as exc:  # InvalidTag
        raise TenantSealError("the sealed blob does not open for this row") from exc


@transaction.atomic
def tenant_key_destroy(*, tenant_id) -> TenantKey:
    """Crypto-shred: erase the tenant's wrapped data key (creating the row first if it never had one, so no key can
    be made for the tenant afterwards). Idempotent: a second call keeps the first destruction time."""
    tenant_key_ensure(tenant_id=tenant_id)
    row = TenantKey.objects.select_for_update(no_key=True).get(tenant_id=tenant_id)
    if row.wrapped_key is not None:
        row.wrapped_key = None
        row.destroyed_at = timezone.now()
        row.save(update_fields=["wrapped_key", "destroyed_at"])
    return row
