"""Migration answers are status-guarded (a stray, duplicate or foreign answer changes nothing) and a failed migration
gives the target's reservation back and leaves the cache where it was. The orders go to the real broker; no node
consumes them here (tests/caches/test_migration.py runs the nodes)."""

import uuid

import pytest

from caches.migration import MigrationConflict, migration_progress, migration_result, migration_start
from caches.models import Cache, Migration
from kcaas.node_protocol.messages import MigrateAbort
from tests.caches.conftest import BLOCK_BYTES, reserved

pytestmark = pytest.mark.django_db(transaction=True)


def test_stray_and_duplicate_answers_change_nothing(placed):
    cache, source, target = placed
    migration = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    assert migration.state == "pending" and reserved(target)["device"] == 8 * BLOCK_BYTES
    with pytest.raises(MigrationConflict):
        migration_start(cache_id=cache.pk, target_node_id=target.pk)  # one active migration per cache
    assert migration_progress(migration_id=migration.pk, node_id=source.pk, phase="ready", info={}) is None
    assert migration_result(migration_id=migration.pk, node_id=uuid.uuid4(), ok=True) is None
    assert migration_result(migration_id="not-a-uuid", node_id=source.pk, ok=True) is None
    assert migration_result(migration_id=migration.pk, node_id=target.pk, ok=True) is None  # only the source cuts over
    assert Migration.objects.get(pk=migration.pk).state == "pending"
    assert Cache.objects.get(pk=cache.pk).node_id == source.pk


def test_failed_migration_releases_the_target_and_keeps_the_cache(placed):
    cache, source, target = placed
    migration = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    failed = migration_result(migration_id=migration.pk, node_id=target.pk, ok=False, reason="insufficient_capacity")
    assert failed.state == "failed" and failed.failure_reason == "insufficient_capacity"
    assert reserved(target)["device"] == 0
    assert migration_result(migration_id=migration.pk, node_id=target.pk, ok=False) is None  # a duplicate: no-op
    assert reserved(target)["device"] == 0  # released once
    cache = Cache.objects.get(pk=cache.pk)
    assert (cache.node_id, cache.epoch, cache.state) == (source.pk, 1, "ready")
    again = migration_start(cache_id=cache.pk, target_node_id=target.pk)  # a new migration may start
    assert again.state == "pending"


def test_migrating_to_its_own_node_is_refused(placed):
    cache, source, _ = placed
    with pytest.raises(MigrationConflict):
        migration_start(cache_id=cache.pk, target_node_id=source.pk)
    assert reserved(source)["device"] == 8 * BLOCK_BYTES  # the refused reservation was rolled back


def test_a_migration_no_node_moves_is_failed_by_the_sweep_and_releases_the_target(placed, settings):
    from datetime import timedelta

    from django.utils import timezone

    from caches.migration import migrations_expire
    from caches.tasks import expire_migrations

    cache, source, target = placed
    settings.KCAAS_MIGRATION_STALL_SECONDS = 60
    fresh = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    assert migrations_expire() == []  # a migration that just started is not stalled
    Migration.objects.filter(pk=fresh.pk).update(updated_at=timezone.now() - timedelta(seconds=120))
    assert expire_migrations.apply().get() == 1  # the beat task, as the system
    stalled = Migration.objects.get(pk=fresh.pk)
    assert (stalled.state, stalled.failure_reason) == ("failed", "stalled")
    assert reserved(target)["device"] == 0
    assert Cache.objects.get(pk=cache.pk).node_id == source.pk  # the cache stays where it was
    assert migrations_expire() == []  # already failed: not again


def test_a_migration_stuck_in_cutover_or_on_a_lost_node_ends_and_the_source_is_told_to_lift_its_fence(placed, settings):
    """A lost result after the source fenced writes used to leave the migration in cutover for ever (and the source
    answering writes MOVED); a lost node, its migrations active for ever. Both end, and the source gets
    migrate_abort (through the outbox) so it takes writes again."""
    from datetime import timedelta

    from django.utils import timezone

    from caches.migration import migrations_expire
    from fleet.models import Node, NodeOrder, NodeState
    from kcaas.node_protocol.messages import MIGRATE_ABORT_TASK

    cache, source, target = placed
    settings.KCAAS_MIGRATION_STALL_SECONDS = 60
    migration = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    migration_progress(migration_id=migration.pk, node_id=target.pk, phase="ready", info={})
    migration_progress(migration_id=migration.pk, node_id=source.pk, phase="fenced", info={})
    assert Migration.objects.get(pk=migration.pk).state == "cutover"
    assert migrations_expire() == []
    Migration.objects.filter(pk=migration.pk).update(updated_at=timezone.now() - timedelta(seconds=120))
    assert migrations_expire() == [migration.pk]
    assert Migration.objects.get(pk=migration.pk).failure_reason == "stalled"
    abort = NodeOrder.objects.get(node=source, task=MIGRATE_ABORT_TASK)
    assert abort.args == MigrateAbort(migration_id=str(migration.pk), cache_id=str(cache.pk)).to_dict()
    assert reserved(target)["device"] == 0 and Cache.objects.get(pk=cache.pk).state == "ready"

    again = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    Node.objects.filter(pk=target.pk).update(state=NodeState.LOST)
    assert migrations_expire() == [again.pk]  # not stalled: its target is gone
    assert Migration.objects.get(pk=again.pk).failure_reason == "node_lost"
