"""Drain with real agent PROCESSES: two node agents (platform identity from a CSR at register, a mutual-TLS
migration listener on KCAAS_NODE_MIGRATION_LISTEN), the live control plane on PostgreSQL and its Celery worker.
A tenant's client keeps putting and getting through the SDK while staff drain the cache's node; the cache's blocks
live mostly in DRAM (8 device blocks), so the lower-tier path of the migration is exercised too.

Checked afterwards: the cache is on the other node at epoch + 1; every acknowledged put reads back bit-exact
through the same SDK client (which followed MOVED); no read during the move returned wrong KV; the drained node is
`draining`, has no reservation and reports no resident cache; CACHE_MIGRATED is audited once.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from django.utils import timezone

import kcaas
from audit.actions import AuditAction
from audit.models import AuditEvent
from caches.models import Cache, Migration
from fleet.models import Node, NodeState
from kcaas.dataplane import DataPlaneClient
from tests.caches.conftest import fast_password_hasher, reserved, staff_client  # noqa: F401 (fixtures)
from tests.e2e.conftest import random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
SEQ_TOKENS = 64  # 4 full blocks of 16
MAX_PUTS = 14  # 56 blocks: fits the cache's 8 device + 64 DRAM blocks


class PutGetLoop(threading.Thread):
    """Puts new sequences and reads back earlier ones until stopped. `acked` holds every put the node acknowledged
    (tokens, kv); `errors` anything unexpected, including a read that returned other bytes than were put."""

    def __init__(self, dp: DataPlaneClient, spec):
        super().__init__(daemon=True, name="sdk-client")
        self.dp, self.spec = dp, spec
        self.acked: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seed = 0
        while not self.stop.is_set():
            try:
                if len(self.acked) < MAX_PUTS:
                    self._put(seed)
                    seed += 1
                self._check(self.acked[seed % len(self.acked)])
            except Exception as exc:  # noqa: BLE001 (reported to the test, which fails on it)
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            time.sleep(0.05)

    def _put(self, seed: int) -> None:
        tokens, kv = random_tokens(SEQ_TOKENS, seed=1000 + seed)[0], random_kv(self.spec, SEQ_TOKENS, seed=2000 + seed)
        if self.dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS:
            self.acked.append((tokens, kv))

    def _check(self, pair) -> None:
        n, got = self.dp.get(pair[0])
        if n != SEQ_TOKENS or not torch.equal(got, pair[1]):  # the cache holds all 14 sequences, so: never a miss
            self.errors.append(f"read {n} tokens of put {self.acked.index(pair)} on {self.dp.endpoint}")


def test_drain_moves_a_live_cache_between_agent_processes(
    live_server, agent_launcher, pki, model, settings, staff_client, monkeypatch
):
    spec = spec_for(model)
    settings.KCAAS_NODE_HEARTBEAT_SECONDS = 1  # resident snapshots come quickly
    monkeypatch.setenv("KCAAS_NODE_MIGRATION_LISTEN", "127.0.0.1:0")
    monkeypatch.setenv("KCAAS_NODE_DRAM_BYTES", str(256 * spec.block_bytes))
    agents = {agent.node_id: agent for agent in (agent_launcher.start(), agent_launcher.start())}
    client = kcaas.Client(live_server.url, tenant_key())
    try:
        cache = client.attach(
            "moving", spec, {"device": 8 * spec.block_bytes, "dram": 64 * spec.block_bytes}, timeout=30
        )
        source = Cache.objects.get(pk=cache.id).node_id
        (target,) = set(agents) - {source}
        with tenant_dataplane(client, cache, spec, pki) as dp:
            loop = PutGetLoop(dp, spec)
            loop.start()
            assert eventually(lambda: len(loop.acked) >= 10 or loop.errors, timeout=20) and not loop.errors
            drained_at = timezone.now()
            response = staff_client.post(f"/api/v1/admin/nodes/{source}/drain")
            assert response.status_code == 200, response.content
            assert len(response.json()["migrations"]) == 1
            assert eventually(lambda: Cache.objects.get(pk=cache.id).node_id == target, timeout=40)
            assert eventually(lambda: len(loop.acked) >= MAX_PUTS or loop.errors, timeout=20)
            # the source answers MOVED once its cutover order arrives (just after the control plane's flip): the
            # loop's next request then follows it
            assert eventually(lambda: dp.endpoint == agents[target].endpoint or loop.errors, timeout=20)
            loop.stop.set()
            loop.join(30)
            assert not loop.errors, (loop.errors, cache.endpoint, len(loop.acked))
            assert_every_put_reads_back(dp, loop.acked, agents[target].endpoint)
        assert_moved(cache, source, target, drained_at)
    finally:
        client.close()


def assert_every_put_reads_back(dp: DataPlaneClient, acked, target_endpoint: str) -> None:
    assert dp.endpoint == target_endpoint  # the SDK followed MOVED to the target
    found = [dp.get(tokens)[0] for tokens, _ in acked]
    assert found == [SEQ_TOKENS] * len(acked)
    for tokens, kv in acked:
        n, got = dp.get(tokens)
        assert n == SEQ_TOKENS and torch.equal(got, kv)  # bit-exact, every acknowledged put


def assert_moved(cache, source, target, drained_at) -> None:
    row = Cache.objects.get(pk=cache.id)
    assert (row.node_id, row.epoch, row.state) == (target, cache.epoch + 1, "ready")
    migration = Migration.objects.get(cache_id=cache.id)
    assert migration.state == "complete" and migration.blocks_copied > 8  # more than the device pool holds
    assert Node.objects.get(pk=source).state == NodeState.DRAINING
    assert reserved(Node.objects.get(pk=source)) == {"device": 0, "dram": 0, "ssd": 0}
    assert eventually(lambda: reports_nothing(source, drained_at), timeout=15)  # the agent let the cache go
    assert AuditEvent.objects.filter(action=AuditAction.CACHE_MIGRATED, target_id=str(cache.id)).count() == 1


def reports_nothing(node_id, since) -> bool:
    snapshot = Node.objects.get(pk=node_id).resident_snapshot or {}
    reported = snapshot.get("reported_at")
    return bool(reported) and reported > since.isoformat() and not snapshot.get("caches")
