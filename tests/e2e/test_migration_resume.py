"""Resumable migration against the real service (issue 6): two node agent PROCESSES with mutual-TLS migration
listeners and SSD tiers, the live control plane and its worker. One side is SIGKILLed mid-copy (the sender is paced
by KCAAS_NODE_MIGRATION_MAX_BYTES_PER_SECOND so the copy lasts long enough to cut) and restarted with the same
credential, endpoint, listener port and SSD directory; its re-registration re-drives the migration
(caches.migration.migrations_redrive_node) and the migration completes.

- target killed: the restarted target republishes the blocks it had journaled (SSD write-through), and the
  resumed sender sends only the others (the restarted target's kcaas_migration_blocks_received_total counts
  exactly T - restored: no verified block crossed the wire twice); KV is bit-exact on the target;
- source killed: its device-only blocks die with it, so the re-driven sender has (almost) nothing to send; the
  migration completes with what the target already verified, and every block the target serves is right (a
  prefix of a sequence is either served bit-exact or missed, never wrong).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import kcaas
from caches.migration import migration_start
from caches.models import Cache, Migration
from gpu_node.migration.journal import JOURNAL_NAME, MAGIC, RECORD
from tests.caches.conftest import free_port
from tests.e2e.conftest import random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key

pytestmark = pytest.mark.django_db(transaction=True)
SEQ_TOKENS = 64  # 4 full blocks of 16
NUM_SEQS = 12  # 48 blocks: about 1.2 s at 40 blocks a second
JOURNAL_HEADER = len(MAGIC) + 36


class Nodes:
    """Starts/restarts agents with their own SSD directory and migration listener port (the env the launcher
    passes on is read at spawn time)."""

    def __init__(self, launcher, monkeypatch, tmp_path: Path):
        self.launcher, self.monkeypatch, self.tmp_path = launcher, monkeypatch, tmp_path
        self.settings: dict = {}  # node id -> (ssd dir, listen port)

    def _env(self, ssd_dir: Path, port: int) -> None:
        self.monkeypatch.setenv("KCAAS_NODE_SSD_DIR", str(ssd_dir))
        self.monkeypatch.setenv("KCAAS_NODE_MIGRATION_LISTEN", f"127.0.0.1:{port}")

    def start(self, name: str):
        ssd_dir, port = self.tmp_path / f"ssd-{name}", free_port()
        self._env(ssd_dir, port)
        agent = self.launcher.start()
        self.settings[agent.node_id] = (ssd_dir, port)
        return agent

    def restart(self, agent):
        self._env(*self.settings[agent.node_id])
        return self.launcher.restart(agent)

    def journal_records(self, agent, cache_id: str) -> int:
        path = self.settings[agent.node_id][0] / cache_id / JOURNAL_NAME
        size = path.stat().st_size if path.exists() else 0
        return max(0, size - JOURNAL_HEADER) // (RECORD.size + 4 * 16)


@pytest.fixture
def nodes(agent_launcher, monkeypatch, tmp_path, model):
    block_bytes = spec_for(model).block_bytes
    monkeypatch.setenv("KCAAS_NODE_SSD_BYTES", str(1024 * block_bytes))
    monkeypatch.setenv("KCAAS_NODE_MIGRATION_MAX_BYTES_PER_SECOND", str(40 * block_bytes))
    return Nodes(agent_launcher, monkeypatch, tmp_path)


def metric(agent, name: str) -> float:
    """The sum of a counter's samples on an agent's /metrics (its port is in the process's environment)."""
    environ = Path(f"/proc/{agent.process.pid}/environ").read_bytes().split(b"\0")
    port = next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"KCAAS_NODE_METRICS_PORT="))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def cache_with_data(live_server, pki, spec):
    client = kcaas.Client(live_server.url, tenant_key())
    cache = client.attach("moving", spec, {"device": 64 * spec.block_bytes, "ssd": 256 * spec.block_bytes}, timeout=30)
    sequences = [
        (random_tokens(SEQ_TOKENS, seed=s)[0], random_kv(spec, SEQ_TOKENS, seed=s + 100)) for s in range(NUM_SEQS)
    ]
    with tenant_dataplane(client, cache, spec, pki) as dp:
        for tokens, kv in sequences:
            assert dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS
    return client, cache, sequences


def served(client, cache_id, spec, pki, sequences) -> list[int]:
    """Tokens served per sequence from where the cache is now; every served prefix must be bit-exact."""
    now = client.get_cache(cache_id)
    counts = []
    with tenant_dataplane(client, now, spec, pki, access="read") as dp:
        for tokens, kv in sequences:
            n, got = dp.get(tokens)
            assert n == 0 or torch.equal(got, kv[:, :, :n])  # never wrong KV
            counts.append(n)
    return counts


def kill_mid_copy(nodes, victim, target, cache_id, migration) -> int:
    """SIGKILL `victim` once the target journaled some blocks but the copy is not done; returns the records."""
    wait(lambda: nodes.journal_records(target, cache_id) >= 8, 30, "the target to journal 8 blocks")
    victim.kill()
    assert Migration.objects.get(pk=migration.pk).state in ("pending", "copying")  # killed mid-copy
    return nodes.journal_records(target, cache_id)


def test_killed_target_resumes_without_resending_verified_blocks(live_server, nodes, pki, model):
    spec = spec_for(model)
    nodes.start("source")  # the only node yet: the cache is placed there
    client, cache, sequences = cache_with_data(live_server, pki, spec)
    target = nodes.start("target")
    try:
        migration = migration_start(cache_id=cache.id, target_node_id=target.node_id)
        journaled = kill_mid_copy(nodes, target, target, cache.id, migration)
        target = nodes.restart(target)
        wait(lambda: Migration.objects.get(pk=migration.pk).state == "complete", 90, "the migration to complete")
        restored = metric(target, "kcaas_migration_blocks_restored_total")
        received = metric(target, "kcaas_migration_blocks_received_total")
        assert 0 < restored <= journaled
        assert received == NUM_SEQS * 4 - restored  # only what the restarted target lacked crossed the wire
        assert Cache.objects.get(pk=cache.id).node_id == target.node_id
        assert served(client, cache.id, spec, pki, sequences) == [SEQ_TOKENS] * NUM_SEQS  # all of it, bit-exact
    finally:
        client.close()


def test_killed_source_restarts_and_the_migration_completes_with_what_survived(live_server, nodes, pki, model):
    spec = spec_for(model)
    source = nodes.start("source")
    client, cache, sequences = cache_with_data(live_server, pki, spec)
    target = nodes.start("target")
    try:
        migration = migration_start(cache_id=cache.id, target_node_id=target.node_id)
        journaled = kill_mid_copy(nodes, source, target, cache.id, migration)
        source = nodes.restart(source)
        wait(lambda: Migration.objects.get(pk=migration.pk).state == "complete", 90, "the migration to complete")
        moved = Cache.objects.get(pk=cache.id)
        assert (moved.node_id, moved.epoch, moved.state) == (target.node_id, 2, "ready")
        counts = served(client, cache.id, spec, pki, sequences)
        assert sum(counts) >= journaled * 16 - SEQ_TOKENS  # what the target verified is kept (bit-exact)
        assert source.alive and os.path.exists(f"/proc/{source.process.pid}")
    finally:
        client.close()
