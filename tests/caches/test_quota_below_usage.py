"""Quota values as people write them (an integer, or "1GiB" for bytes, in REST as in the console; a count or a bare
number in a JSON string is refused), and a quota lowered below what a tenant already uses: accepted (nothing is
taken away), flagged in GET /api/v1/usage, and new attaches refused."""

import pytest

from tenants.quota_values import QuotaValueError, quota_value_parse, string_pattern
from tests.caches.conftest import BLOCK_BYTES, GIB, attach_body, purge_node_queue

pytestmark = pytest.mark.django_db

BOUNDS = (0, 2**50)


@pytest.fixture
def node(make_node):
    made = make_node()
    yield made
    purge_node_queue(made.pk)


@pytest.mark.parametrize(
    "value, expected",
    [
        (1024, 1024),
        ("1GiB", GIB),
        ("512 MiB", 512 * 2**20),
        ("3kib", 3072),
        (7, 7),
        (0, 0),
        ("2 TiB", 2**41),
        ("8 B", 8),
    ],
)
def test_byte_limits_take_integers_and_binary_units(value, expected):
    assert quota_value_parse("max_device_bytes", value, bounds=BOUNDS) == expected


BAD_BYTES = ["1.5GiB", "1GB", "-1", "GiB", "", "1 GiB extra", "0x10", "007", " 1GiB", "9PiB", True, 1.0, None, [1]]
BAD_BYTES += ["7", "0", "1048576"]  # a bare number is an integer, never a JSON string


@pytest.mark.parametrize("value", BAD_BYTES)
def test_byte_limits_refuse_anything_else(value):
    with pytest.raises(QuotaValueError, match="whole number of bytes"):
        quota_value_parse("max_device_bytes", value, bounds=BOUNDS)


def test_count_limits_take_integers_only_and_bounds_hold():
    assert quota_value_parse("max_caches", 12, bounds=(0, 100)) == 12
    for value in ("12", "5GiB", 12.0, True):
        with pytest.raises(QuotaValueError, match="A whole number, as an integer"):
            quota_value_parse("max_caches", value, bounds=(0, 100))
    with pytest.raises(QuotaValueError, match="Between 0 and 100"):
        quota_value_parse("max_caches", 101, bounds=(0, 100))


def test_every_string_the_published_pattern_takes_is_within_bounds():
    # per unit only as many digits as always fit: the largest schema-valid strings parse to at most the bound
    pattern = string_pattern("max_device_bytes", (0, 2**50))
    assert "[Tt][Ii][Bb]" in pattern and "[Pp]" not in pattern  # 9PiB would not fit 1 PiB: written as an integer
    assert quota_value_parse("max_device_bytes", "999TiB", bounds=(0, 2**50)) == 999 * 2**40
    assert "|[0-9]" not in pattern and not pattern.startswith("^(?:[0-9]{")  # every string names a unit
    with pytest.raises(QuotaValueError):
        quota_value_parse("max_requests_per_second", 0, bounds=(1, 100_000))
    with pytest.raises(ValueError, match="integers only"):
        string_pattern("max_caches", (0, 100))


def test_rest_quota_patch_takes_unit_strings(staff_client, tenant_a):
    url = f"/api/v1/admin/tenants/{tenant_a.tenant.pk}/quota"
    body = staff_client.patch(url, {"max_device_bytes": "1GiB", "max_caches": 4}, format="json")
    assert body.status_code == 200, body.content
    assert body.json()["max_device_bytes"] == GIB and body.json()["max_caches"] == 4
    for bad in ({"max_caches": "5"}, {"max_caches": 5.0}, {"max_caches": True}, {"max_device_bytes": "1048576"}):
        refused = staff_client.patch(url, bad, format="json")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "validation_error", bad
        assert set(refused.json()["error"]["details"]["fields"]) == set(bad)
    assert staff_client.get(url).json()["overrides"]["max_caches"] == 4  # the refusals changed nothing
    refused = staff_client.patch(url, {"max_dram_bytes": "1.5GiB"}, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "validation_error"
    assert "max_dram_bytes" in refused.json()["error"]["details"]["fields"]
    assert staff_client.get(url).json()["overrides"]["max_dram_bytes"] is None  # the refusal changed nothing


def test_a_quota_below_use_is_accepted_flagged_and_stops_new_attaches(staff_client, tenant_a, node):
    attached = tenant_a.client.post("/api/v1/caches", attach_body(name="big", device=64 * BLOCK_BYTES), format="json")
    assert attached.status_code == 201, attached.content
    assert tenant_a.client.get("/api/v1/usage").json()["over_quota"] is False

    url = f"/api/v1/admin/tenants/{tenant_a.tenant.pk}/quota"
    lowered = staff_client.patch(url, {"max_device_bytes": 16 * BLOCK_BYTES}, format="json")
    assert lowered.status_code == 200, lowered.content

    usage = tenant_a.client.get("/api/v1/usage").json()
    assert usage["over_quota"] is True and usage["over_quota_limits"] == ["max_device_bytes"]
    assert usage["used"]["device_bytes"] == 64 * BLOCK_BYTES  # nothing was taken away
    again = tenant_a.client.post("/api/v1/caches", attach_body(name="more", device=BLOCK_BYTES), format="json")
    assert again.status_code == 403 and again.json()["error"]["code"] == "quota_exceeded"
