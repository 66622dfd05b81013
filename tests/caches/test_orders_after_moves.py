"""Orders that became moot while they waited in the outbox are never sent with stale arguments: a failed
migration's detach of the target's copy does not outlive a newer migration to that node at the same epoch (a re-send
after the cutover would drop the live cache), and a pending migration's migrate_in is not sent once its cache left
service (an erasure: the keys are shredded) — nor does an order whose builder fails hold up every other order.
Real PostgreSQL and the real broker; no node consumes the orders here."""

from datetime import timedelta

import pytest
from django.utils import timezone

from caches.migration import migration_progress, migration_result, migration_start
from caches.models import Cache, CacheState
from fleet.models import NodeOrder, OrderState
from fleet.outbox import open_orders, orders_dispatch
from kcaas.node_protocol.messages import DETACH_TASK, MIGRATE_IN_TASK, DetachCache
from privacy import services as privacy
from privacy.models import ErasureState
from tenants import tenant_keys

pytestmark = pytest.mark.django_db(transaction=True)


def later(minutes: float = 5):
    return timezone.now() + timedelta(minutes=minutes)


def test_a_failed_migrations_detach_does_not_outlive_a_new_migration_to_the_same_node(placed):
    cache, source, target = placed
    first = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    migration_progress(migration_id=first.pk, node_id=target.pk, phase="ready", info={})
    migration_result(migration_id=first.pk, node_id=source.pk, ok=False, reason="ConnectionError")
    (detach,) = [o for o in open_orders(node_id=target.pk) if o.task == DETACH_TASK]
    assert (
        detach.args == DetachCache(cache_id=str(cache.pk), epoch=2, forget_network=False).to_dict()
    )  # the target's copy at epoch_to; its answer is lost, it is re-sent
    second = migration_start(cache_id=cache.pk, target_node_id=target.pk)  # the same target, the same epoch_to
    migration_progress(migration_id=second.pk, node_id=target.pk, phase="ready", info={})
    migration_result(migration_id=second.pk, node_id=source.pk, ok=True, info={"blocks": 3})
    cache.refresh_from_db()
    assert (cache.node_id, cache.epoch, cache.state) == (target.pk, 2, CacheState.READY)
    old_detach = DetachCache(cache_id=str(cache.pk), epoch=2, forget_network=False).to_dict()
    stale = [o for o in open_orders(node_id=target.pk) if o.task == DETACH_TASK and o.args == old_detach]
    assert stale == [], "a re-send of the old detach would drop the cache the target now serves at epoch 2"


def test_a_pending_migrate_in_is_not_sent_once_its_cache_was_erased(placed, tenant_a, settings):
    settings.KCAAS_ERASURE_GRACE_SECONDS = 0
    cache, source, target = placed
    migration = migration_start(cache_id=cache.pk, target_node_id=target.pk)  # the target never answers
    job, _ = privacy.erasure_request(tenant_id=tenant_a.tenant.pk, requested_by="system:")
    assert privacy.erasure_start(job_id=job.pk, now=later(0.1)).state == ErasureState.RUNNING
    assert Cache.objects.get(pk=cache.pk).state == CacheState.DETACHED
    orders_dispatch(now=later(1))  # the re-send after the purge: the target must not get the tenant's keys again
    order = NodeOrder.objects.get(node=target, task=MIGRATE_IN_TASK)
    assert (order.state, order.last_error, order.attempts) == (OrderState.DONE, "moot", 1), migration.pk


def test_an_order_whose_keys_no_longer_open_does_not_stop_the_dispatcher(placed, tenant_a, make_node):
    cache, source, target = placed
    migration_start(cache_id=cache.pk, target_node_id=target.pk)  # migrate_in: keys unsealed at send time
    tenant_keys.tenant_key_destroy(tenant_id=tenant_a.tenant.pk)  # its keys are shredded while it waits
    other = make_node()
    NodeOrder.objects.create(
        node=other,
        task=DETACH_TASK,
        key="cache:other",
        args=["x", 1],
        state=OrderState.PENDING,  # a row from before typed messages
        next_attempt_at=timezone.now() + timedelta(minutes=2),
    )  # due after it
    counts = orders_dispatch(now=later(5))  # raised SealError, rolling back every send of the run
    assert counts["sent"] >= 1
    assert NodeOrder.objects.get(node=other, key="cache:other").state == OrderState.SENT
    assert NodeOrder.objects.get(node=target, task=MIGRATE_IN_TASK).state == OrderState.DONE  # moot: nothing to send
