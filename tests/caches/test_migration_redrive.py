"""A node that registers again (a restart) while it is the target or the source of an active migration gets that
migration re-driven (settings.KCAAS_NODE_REGISTER_HOOKS -> caches.migration.migrations_redrive_node): the migration
goes back to pending and migrate_in goes to the target again, whose "ready" sends migrate_out to the source again.
Finished migrations, and nodes that take part in none, are left alone. The orders go to the real broker; no node
consumes them here (tests/e2e/test_migration_resume.py runs real agents)."""

import pytest
from django.conf import settings
from django.utils.module_loading import import_string

from caches.migration import migration_progress, migration_result, migration_start, migrations_redrive_node
from caches.models import Migration

pytestmark = pytest.mark.django_db  # one wrapping transaction: on-commit orders are captured, not run


def registered_again(node_id, capture) -> int:
    """Run every register hook as the register view does; returns how many orders left on commit."""
    with capture() as sent:
        for hook in settings.KCAAS_NODE_REGISTER_HOOKS:
            import_string(hook)(node_id=node_id)
    return len(sent)


def state(migration) -> str:
    return Migration.objects.get(pk=migration.pk).state


def test_restarted_source_or_target_gets_its_orders_again(placed, django_capture_on_commit_callbacks):
    cache, source, target = placed
    migration = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    assert registered_again(source.pk, django_capture_on_commit_callbacks) == 0  # pending: the target will answer
    assert state(migration) == "pending"
    assert registered_again(target.pk, django_capture_on_commit_callbacks) == 1  # migrate_in again
    assert migration_progress(migration_id=migration.pk, node_id=target.pk, phase="ready", info={}).state == "copying"
    assert registered_again(source.pk, django_capture_on_commit_callbacks) == 1  # the source lost its sender
    assert state(migration) == "pending"  # the target's next "ready" sends migrate_out to the source again
    assert migration_progress(migration_id=migration.pk, node_id=target.pk, phase="ready", info={}).state == "copying"
    assert registered_again(target.pk, django_capture_on_commit_callbacks) == 1
    assert state(migration) == "pending"
    assert migration_progress(migration_id=migration.pk, node_id=target.pk, phase="ready", info={}).state == "copying"
    assert migration_result(migration_id=migration.pk, node_id=source.pk, ok=True).state == "complete"
    assert migrations_redrive_node(node_id=target.pk) == [] and migrations_redrive_node(node_id=source.pk) == []
    assert state(migration) == "complete"  # a finished migration is never re-driven


def test_failed_migration_is_not_redriven(placed, django_capture_on_commit_callbacks):
    cache, source, target = placed
    migration = migration_start(cache_id=cache.pk, target_node_id=target.pk)
    migration_result(migration_id=migration.pk, node_id=target.pk, ok=False, reason="insufficient_capacity")
    assert registered_again(target.pk, django_capture_on_commit_callbacks) == 0
    assert state(migration) == "failed"
