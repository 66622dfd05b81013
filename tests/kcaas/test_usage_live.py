"""kcaas.Client.usage() against the live control plane (real socket, PostgreSQL, Redis, Celery workers)."""

import pytest

from kcaas import errors
from kcaas.spec import KVCacheSpec
from kcaas.usage import Usage
from tests.caches.conftest import BLOCK_BYTES, SPEC

pytestmark = pytest.mark.django_db(transaction=True)


def test_usage_follows_attach_tokens_and_detach(make_tenant, node, sdk):
    handle = make_tenant(max_caches=4, max_device_bytes=1024 * BLOCK_BYTES)
    client = sdk(handle.raw_key)

    empty = client.usage()
    assert isinstance(empty, Usage) and empty.tenant_id == str(handle.tenant.pk)
    assert empty.limits["max_caches"] == 4 and empty.limits["max_device_bytes"] == 1024 * BLOCK_BYTES
    assert empty.used["caches"] == 0 and empty.remaining()["caches"] == 4

    seen = []
    cache = client.attach(
        "chat",
        KVCacheSpec(**SPEC),
        {"device": 64 * BLOCK_BYTES, "dram": 32 * BLOCK_BYTES},
        timeout=20,
        progress=lambda c: seen.append(c.state),
    )
    assert seen[0] == "provisioning" and seen[-1] == "ready"  # the progress hook saw every polled state
    client.issue_token(cache.id, access="read")

    used = client.usage()
    assert used.used == {
        "caches": 1,
        "device_bytes": 64 * BLOCK_BYTES,
        "dram_bytes": 32 * BLOCK_BYTES,
        "ssd_bytes": 0,
        "network_bytes": 0,
        "data_tokens_outstanding": 1,
        "api_keys": 1,
    }
    assert used.remaining()["device_bytes"] == (1024 - 64) * BLOCK_BYTES
    assert set(used.resident) == {"device_bytes", "dram_bytes", "ssd_bytes", "network_bytes"}

    client.detach(cache.id, wait=True, timeout=20)
    after = client.usage()
    # detaching revoked the cache's token and the detached cache no longer counts
    assert after.used["caches"] == 0 and after.used["device_bytes"] == 0 and after.used["data_tokens_outstanding"] == 0


def test_usage_is_confined_to_the_callers_tenant(make_tenant, node, sdk):
    a, b = make_tenant(), make_tenant()
    sdk(a.raw_key).attach("a-only", SPEC, {"device": 16 * BLOCK_BYTES}, wait=False)
    assert sdk(a.raw_key).usage().used["caches"] == 1
    other = sdk(b.raw_key).usage()
    assert other.tenant_id == str(b.tenant.pk) and other.used["caches"] == 0


def test_usage_without_the_scope_is_a_permission_error(make_tenant, sdk):
    client = sdk(make_tenant(scopes=("keys:read",)).raw_key)
    with pytest.raises(errors.PermissionDeniedError) as caught:
        client.usage()
    assert caught.value.status == 403 and caught.value.details == {"required_scope": "caches:read"}
