"""Heartbeat samples (fleet.samples): written through the heartbeat endpoint and service, one heartbeat per node per
KCAAS_SAMPLE_SECONDS kept, read back in buckets (the latest sample of each cache in a bucket), pruned after the
retention."""

from datetime import UTC, datetime, timedelta

from django.utils import timezone

from fleet import samples, services
from fleet.models import ResidentSample
from tests.fleet.conftest import GIB, capacity_body

HEARTBEAT = "/api/v1/nodes/heartbeat"
CACHE_A, CACHE_B = "0b7f3c1e-5d2a-4b8e-9f10-1a2b3c4d5e6f", "7a1e2b3c-4d5e-4f60-8a7b-9c0d1e2f3a4b"
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def _beat(node, at, *entries):
    capacity = {"device": 8 * GIB, "dram": 0, "ssd": 0}
    return services.node_heartbeat(node_id=node.pk, capacity=capacity, resident=list(entries), now=at)


def test_the_heartbeat_endpoint_stores_one_sample_per_cache(make_node):
    handle = make_node("n1", device=8 * GIB)
    resident = [
        {"cache_id": CACHE_A, "device_bytes": 1024, "hit_tokens": 7, "miss_tokens": 3},
        {"cache_id": CACHE_B, "dram_bytes": 2048},
    ]
    response = handle.client.post(HEARTBEAT, {"capacity": capacity_body(), "resident": resident}, format="json")
    assert response.status_code == 200, response.json()
    rows = {
        str(r.cache_id): (r.device_bytes, r.dram_bytes, r.ssd_bytes, r.hit_tokens, r.miss_tokens)
        for r in ResidentSample.objects.all()
    }
    assert rows == {CACHE_A: (1024, 0, 0, 7, 3), CACHE_B: (0, 2048, 0, 0, 0)}


def test_one_heartbeat_per_interval_is_kept_and_a_heartbeat_without_resident_adds_none(make_node, settings):
    settings.KCAAS_SAMPLE_SECONDS = 60
    node = make_node("n1", device=8 * GIB, now=T0).node
    _beat(node, T0, {"cache_id": CACHE_A, "device_bytes": 1})
    _beat(node, T0 + timedelta(seconds=30), {"cache_id": CACHE_A, "device_bytes": 2})  # inside the interval
    services.node_heartbeat(node_id=node.pk, capacity={"device": 8 * GIB, "dram": 0, "ssd": 0}, now=T0)
    _beat(node, T0 + timedelta(seconds=61), {"cache_id": CACHE_A, "device_bytes": 3})
    assert list(ResidentSample.objects.order_by("sampled_at").values_list("device_bytes", flat=True)) == [1, 3]


def test_series_take_each_caches_latest_sample_per_bucket(make_node, settings):
    settings.KCAAS_SAMPLE_SECONDS = 1
    one = make_node("n1", device=8 * GIB, now=T0).node
    two = make_node("n2", device=8 * GIB, now=T0).node
    _beat(one, T0 + timedelta(minutes=5), {"cache_id": CACHE_A, "device_bytes": 100, "hit_tokens": 1})
    _beat(
        one, T0 + timedelta(minutes=50), {"cache_id": CACHE_A, "device_bytes": 300, "hit_tokens": 3, "miss_tokens": 1}
    )
    _beat(two, T0 + timedelta(minutes=20), {"cache_id": CACHE_B, "ssd_bytes": 50, "miss_tokens": 4})
    _beat(one, T0 + timedelta(hours=2, minutes=1), {"cache_id": CACHE_A, "dram_bytes": 7})
    fleet = samples.resident_series(start=T0, end=T0 + timedelta(hours=3), bucket=timedelta(hours=1))
    assert [p.start for p in fleet] == [T0, T0 + timedelta(hours=1), T0 + timedelta(hours=2)]
    assert fleet[0].resident_bytes == {"device": 300, "dram": 0, "ssd": 50, "network": 0} and fleet[0].samples == 2
    assert (fleet[0].hit_tokens, fleet[0].miss_tokens, fleet[0].hit_rate) == (3, 5, 3 / 8)
    assert fleet[1].samples == 0 and fleet[1].hit_rate is None
    assert fleet[2].resident_bytes == {"device": 0, "dram": 7, "ssd": 0, "network": 0}
    mine = samples.resident_series(start=T0, end=T0 + timedelta(hours=1), bucket=timedelta(hours=1), node_id=two.pk)
    assert mine[0].resident_bytes == {"device": 0, "dram": 0, "ssd": 50, "network": 0}
    by_cache = samples.resident_series(
        start=T0, end=T0 + timedelta(hours=1), bucket=timedelta(hours=1), cache_ids=[CACHE_A]
    )
    assert by_cache[0].resident_bytes["device"] == 300 and by_cache[0].miss_tokens == 1


def test_prune_forgets_samples_past_the_retention(make_node, settings):
    settings.KCAAS_SAMPLE_SECONDS, settings.KCAAS_SAMPLE_RETENTION_DAYS = 1, 30
    node = make_node("n1", device=8 * GIB, now=T0).node
    _beat(node, T0, {"cache_id": CACHE_A, "device_bytes": 1})
    _beat(node, T0 + timedelta(days=2), {"cache_id": CACHE_A, "device_bytes": 2})
    assert samples.samples_prune(now=T0 + timedelta(days=31)) == 1
    assert list(ResidentSample.objects.values_list("device_bytes", flat=True)) == [2]


def test_the_beat_schedule_prunes_samples_hourly(make_node, settings):
    from fleet.tasks import prune_samples

    entry = settings.CELERY_BEAT_SCHEDULE["fleet-prune-samples"]
    assert entry["task"] == prune_samples.name == "fleet.prune_samples" and entry["schedule"] <= 3600
    settings.KCAAS_SAMPLE_SECONDS, settings.KCAAS_SAMPLE_RETENTION_DAYS = 1, 30
    past = timezone.now() - timedelta(days=31)  # past the retention
    node = make_node("n1", device=8 * GIB, now=past).node
    _beat(node, past, {"cache_id": CACHE_A, "device_bytes": 1})
    assert prune_samples.apply().get() == 1 and not ResidentSample.objects.exists()
