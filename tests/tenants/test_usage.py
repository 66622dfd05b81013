"""Key usage: counted in Redis per request, flushed to PostgreSQL by tenants.flush_key_usage exactly once."""

from datetime import timedelta

import pytest
from django.utils import timezone

from core.celery import app
from tenants import services, usage
from tenants.models import ApiKey, KeyUsageFlush
from tenants.redis_client import get_redis

from .conftest import key_client, run_concurrently

KEYS_URL = "/api/v1/keys"


def _use(raw, times):
    client = key_client(raw)
    for _ in range(times):
        assert client.get(KEYS_URL).status_code == 200


def _counts(*issued):
    return [ApiKey.objects.get(pk=i.api_key.pk).use_count for i in issued]


@pytest.fixture(autouse=True)
def _tasks_discovered():
    app.loader.import_default_modules()  # what a worker does at start: autodiscovery of tasks.py modules


def test_the_task_is_registered_under_its_contract_name():
    assert "tenants.flush_key_usage" in app.tasks


def test_flush_writes_counts_and_last_use_once(tenant, make_key, redis_client):
    first, second = make_key(tenant), make_key(tenant)
    started = timezone.now()
    _use(first.raw_key, 3)
    _use(second.raw_key, 2)
    assert app.tasks["tenants.flush_key_usage"].apply().get() == 1
    assert _counts(first, second) == [3, 2]
    last = ApiKey.objects.get(pk=first.api_key.pk).last_used_at
    assert started - timedelta(seconds=1) <= last <= timezone.now()
    assert not list(redis_client.scan_iter("{kcaas:keyusage}*"))  # all moved

    assert services.api_key_usage_flush() == 0  # nothing new: a rerun changes nothing
    assert _counts(first, second) == [3, 2]
    _use(first.raw_key, 1)
    services.api_key_usage_flush()
    assert _counts(first, second) == [4, 2]
    assert ApiKey.objects.get(pk=first.api_key.pk).last_used_at >= last


def test_a_flush_that_died_after_commit_is_not_applied_twice(issued_key):
    _use(issued_key.raw_key, 5)
    client = get_redis()
    batch = usage.claim_batch(client)
    assert batch.counts == {issued_key.api_key.pk: 5}
    assert services.api_key_usage_apply(batch=batch) is True  # committed ... and the worker dies before release
    _use(issued_key.raw_key, 2)  # uses meanwhile go to the next batch
    assert usage.claim_batch(client).batch_id == batch.batch_id  # the pending batch is handed out again
    services.api_key_usage_flush()  # rerun: skips the applied batch, applies the new one
    assert _counts(issued_key) == [7]
    assert KeyUsageFlush.objects.count() == 2


def test_a_flush_that_died_before_commit_is_retried(issued_key):
    _use(issued_key.raw_key, 4)
    usage.claim_batch(get_redis())  # claimed, never applied
    services.api_key_usage_flush()
    assert _counts(issued_key) == [4]


def test_last_used_never_moves_backwards(issued_key):
    future = timezone.now() + timedelta(days=1)
    ApiKey.objects.filter(pk=issued_key.api_key.pk).update(last_used_at=future)
    _use(issued_key.raw_key, 1)
    services.api_key_usage_flush()
    assert ApiKey.objects.get(pk=issued_key.api_key.pk).last_used_at == future


@pytest.mark.django_db(transaction=True)
def test_concurrent_flushes_apply_each_use_once(make_tenant, make_key):
    issued = make_key(make_tenant())
    _use(issued.raw_key, 6)
    run_concurrently(services.api_key_usage_flush, [()] * 4)
    assert _counts(issued) == [6]


def test_without_redis_usage_is_written_directly(issued_key, settings):
    settings.REDIS_URL = ""
    _use(issued_key.raw_key, 2)
    assert _counts(issued_key) == [2]
    assert services.api_key_usage_flush() == 0


def test_old_flush_records_are_pruned(issued_key):
    KeyUsageFlush.objects.create(
        batch_id="00000000-0000-0000-0000-000000000001", flushed_at=timezone.now() - timedelta(days=3)
    )
    _use(issued_key.raw_key, 1)
    services.api_key_usage_flush()
    assert list(KeyUsageFlush.objects.values_list("num_keys", flat=True)) == [1]
