"""Crypto-shredding: per-tenant data keys (tenants.tenant_keys) seal the caches' hash keys; destroying a tenant's key
makes every blob sealed under it unreadable, for good, while other tenants' blobs and old KEK blobs still open."""

import os
import threading
import uuid

import pytest
from django.db import connections

from caches import services as cache_services
from caches.sealing import HASH_KEY_NUM_BYTES, HashKeyShredded, SealError, hash_key_new_sealed, hash_key_unseal
from kcaas.spec import KVCacheSpec
from tenants import tenant_keys
from tenants.models import TenantKey
from tests.caches.conftest import SPEC

pytestmark = pytest.mark.django_db


def test_a_tenant_key_is_wrapped_under_the_kek_and_created_once(tenant_a):
    tenant_id = tenant_a.tenant.pk
    first = tenant_keys.tenant_key_ensure(tenant_id=tenant_id)
    again = tenant_keys.tenant_key_ensure(tenant_id=tenant_id)
    assert first.key_id == again.key_id and first.key_id.startswith("tk_")
    wrapped = bytes(first.wrapped_key)
    assert len(wrapped) == 1 + 12 + 32 + 16  # version, nonce, AES-GCM of 32 bytes with its tag
    assert TenantKey.objects.filter(tenant_id=tenant_id).count() == 1


def test_new_caches_seal_their_hash_key_under_the_tenant_key(tenant_a, make_node):
    make_node()
    cache = cache_services.cache_attach(
        tenant_id=tenant_a.tenant.pk, name="sealed", spec=KVCacheSpec.from_dict(SPEC), capacity={"device": 64 * 2048}
    )
    sealed = bytes(cache.hash_key_sealed)
    key_id = TenantKey.objects.get(tenant_id=tenant_a.tenant.pk).key_id
    assert tenant_keys.is_tenant_sealed(sealed) and tenant_keys.sealed_key_id(sealed) == key_id
    assert len(hash_key_unseal(cache_id=cache.pk, sealed=sealed)) == HASH_KEY_NUM_BYTES


def test_destroying_the_tenant_key_makes_its_blobs_unreadable_and_no_other(tenant_a, tenant_b):
    cache_a, cache_b = uuid.uuid4(), uuid.uuid4()
    sealed_a = hash_key_new_sealed(cache_id=cache_a, tenant_id=tenant_a.tenant.pk)
    sealed_b = hash_key_new_sealed(cache_id=cache_b, tenant_id=tenant_b.tenant.pk)
    legacy = hash_key_new_sealed(cache_id=cache_a)  # an old KEK-sealed blob (version 1)
    ssd_key = os.urandom(32)  # what issue 6 will seal the same way
    sealed_ssd = tenant_keys.tenant_seal(tenant_id=tenant_a.tenant.pk, plaintext=ssd_key, aad=b"ssd:cache-x")
    assert tenant_keys.tenant_unseal(sealed=sealed_ssd, aad=b"ssd:cache-x", tenant_id=tenant_a.tenant.pk) == ssd_key

    destroyed = tenant_keys.tenant_key_destroy(tenant_id=tenant_a.tenant.pk)
    assert destroyed.wrapped_key is None and destroyed.destroyed_at is not None
    with pytest.raises(HashKeyShredded):
        hash_key_unseal(cache_id=cache_a, sealed=sealed_a)
    with pytest.raises(tenant_keys.TenantKeyDestroyed):
        tenant_keys.tenant_unseal(sealed=sealed_ssd, aad=b"ssd:cache-x")
    with pytest.raises(tenant_keys.TenantKeyDestroyed):  # nothing new is sealed for an erased tenant either
        tenant_keys.tenant_seal(tenant_id=tenant_a.tenant.pk, plaintext=ssd_key, aad=b"ssd:cache-y")
    assert len(hash_key_unseal(cache_id=cache_b, sealed=sealed_b)) == HASH_KEY_NUM_BYTES  # B untouched
    assert len(hash_key_unseal(cache_id=cache_a, sealed=legacy)) == HASH_KEY_NUM_BYTES  # version 1 still opens
    again = tenant_keys.tenant_key_destroy(tenant_id=tenant_a.tenant.pk)
    assert again.destroyed_at == destroyed.destroyed_at  # idempotent


def test_a_tenant_blob_is_bound_to_its_row_and_tenant(tenant_a, tenant_b):
    cache_id = uuid.uuid4()
    sealed = hash_key_new_sealed(cache_id=cache_id, tenant_id=tenant_a.tenant.pk)
    with pytest.raises(SealError):
        hash_key_unseal(cache_id=uuid.uuid4(), sealed=sealed)  # copied onto another cache
    with pytest.raises(tenant_keys.TenantSealError):
        tenant_keys.tenant_unseal(
            sealed=sealed, aad=b"kcaas-cache:" + str(cache_id).encode(), tenant_id=tenant_b.tenant.pk
        )
    for position in (0, 3, len(sealed) - 1):
        tampered = bytearray(sealed)
        tampered[position] ^= 1
        with pytest.raises(SealError):
            hash_key_unseal(cache_id=cache_id, sealed=bytes(tampered))


def test_the_tenant_key_needs_the_kek(tenant_a, settings):
    cache_id = uuid.uuid4()
    sealed = hash_key_new_sealed(cache_id=cache_id, tenant_id=tenant_a.tenant.pk)
    settings.KCAAS_KEK = "another key-encryption key"
    with pytest.raises(SealError):
        hash_key_unseal(cache_id=cache_id, sealed=sealed)


@pytest.mark.django_db(transaction=True)
def test_concurrent_first_uses_agree_on_one_key(make_tenant):
    tenant = make_tenant().tenant
    barrier, key_ids = threading.Barrier(4), []

    def first_use():
        try:
            barrier.wait()
            key_ids.append(tenant_keys.tenant_key_ensure(tenant_id=tenant.pk).key_id)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(key_ids) == 4 and len(set(key_ids)) == 1
