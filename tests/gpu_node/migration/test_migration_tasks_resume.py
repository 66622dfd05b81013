"""The source's migrate_out side (gpu_node/migration/tasks.py NodeMigration) under re-drive: a second migrate_out
while the first one's sender runs starts no second sender, only re-points it; the running sender retries a transfer
the target refused and completes on the new endpoint. Real listeners, real mutual TLS 1.3."""

import dataclasses
import logging

from gpu_node.migration import block_transfer as bt
from gpu_node.migration.tasks import NodeMigration
from gpu_node.migration.transfer import MigrationListener
from kcaas.node_protocol.messages import MIGRATION_RESULT_TASK, MigrateOut
from tests.gpu_node.kv_fixtures import tiny_spec
from tests.gpu_node.migration.test_migration_transfer import (  # noqa: F401 (pki is a fixture)
    DST,
    SRC,
    assert_same,
    client_ctx,
    fill,
    listener_for,
    pki,
    server_ctx,
    two_nodes,
)
from tests.waiting import eventually


def results(answers):
    return [answer for answer in answers if answer.TASK == MIGRATION_RESULT_TASK]


def test_second_migrate_out_repoints_the_running_sender_instead_of_starting_another(pki, caplog):
    caplog.set_level(logging.INFO, logger="kcaas.node.migration")  # the sender logs each refused try it resumes
    spec = tiny_spec()
    source, target, src, dst = two_nodes(spec)
    seqs = fill(src, spec)
    stale = MigrationListener(target, server_ctx(pki["dst"])).start()  # expects nothing: refuses the migration
    listener = listener_for(target, pki)
    own = MigrationListener(source, server_ctx(pki["src"])).start()
    node = NodeMigration(
        registry=source, node_id=SRC, listener=own, client_context=client_ctx(pki["src"]), resume_seconds=20
    )
    answers = []
    order = MigrateOut(
        migration_id="m1",
        cache_id="c1",
        epoch_from=1,
        epoch_to=2,
        target_node_id=DST,
        target_migration_endpoint=stale.endpoint,
        target_endpoint="10.0.0.2:7000",
    )
    try:
        assert node.start_sender(answers.append, order)
        first = node.senders["m1"]
        assert eventually(lambda: any("resuming" in r.getMessage() for r in caplog.records)), "never refused"
        assert first.is_alive() and not results(answers)  # refused at least once: it is retrying, not failed
        repointed = dataclasses.replace(order, target_migration_endpoint=listener.endpoint)
        assert not node.start_sender(answers.append, repointed)
        assert node.senders["m1"] is first  # no second sender
        first.join(20)
    finally:
        for one in (stale, listener, own):
            one.stop()
    (result,) = results(answers)
    assert result.ok is True and result.info["attempts"] >= 2  # refused, then completed on the re-pointed endpoint
    assert result.info["blocks_sent"] == len(bt.snapshot(src)) == listener.stats.blocks_stored  # each block once
    assert_same(dst, spec, seqs)
