"""A cache migrates between two data-plane servers while an SDK client keeps putting and getting: the source fences
writes with MOVED, the placement flips, the source answers MOVED for good, and the client follows to the target
without losing one acknowledged put. Real TLS 1.3 data planes, real mutual-TLS migration listener, real tokens."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from devtools.dev_pki import new_ca, write_node_pki
from gpu_node.agent.registry import CacheRegistry
from gpu_node.dataplane.server import DataPlaneServer, server_tls_context
from gpu_node.migration import block_transfer as bt
from gpu_node.migration.fence import fences_for
from gpu_node.migration.transfer import (
    Incoming,
    MigrationListener,
    MigrationSender,
    mtls_client_context,
    mtls_server_context,
)
from kcaas import wire
from kcaas.dataplane import DataPlaneClient
from tests.gpu_node.dataplane.conftest import CACHE_A, EPOCH, NODE_ID
from tests.gpu_node.kv_fixtures import prefix_kv
from tests.waiting import eventually

TARGET_NODE = "node-2"
# the nodes' platform identities (SPIFFE ids are node UUIDs) for the migration transfer
IDENTITY = {NODE_ID: "6e0de000-0000-4000-8000-0000000000b1", TARGET_NODE: "6e0de000-0000-4000-8000-0000000000b2"}


@dataclass
class Tok:
    token: str
    epoch: int


class PlacementTokens:
    """Issues real signed data tokens for wherever the cache is placed now (the control plane's role here)."""

    def __init__(self, make_token):
        self.make_token, self.node, self.epoch, self.issued = make_token, NODE_ID, EPOCH, 0
        self.invalidated = 0  # the SDK drops its token on MOVED (and on an expired or unknown token)

    def get(self) -> Tok:
        self.issued += 1
        return Tok(self.make_token(CACHE_A, node=self.node, epoch=self.epoch), self.epoch)

    def invalidate(self) -> None:
        self.invalidated += 1


@pytest.fixture
def target(spec, verifier, pki):
    registry = CacheRegistry(device_capacity_bytes=64 << 20, device="cpu")
    registry.provision(
        cache_id=CACHE_A,
        spec=spec,
        capacity={"device": 256 * spec.block_bytes},
        hash_key=CACHE_A.encode() * 4,
        epoch=EPOCH + 1,
    )
    srv = DataPlaneServer(registry, TARGET_NODE, verifier, server_tls_context(pki["cert"], pki["key"]), "127.0.0.1", 0)
    srv.start()
    yield registry, srv
    srv.stop()


@pytest.fixture
def node_pki(tmp_path):
    ca_key, ca_cert = new_ca("platform CA (test)", valid_for=dt.timedelta(hours=1))
    return {n: write_node_pki(tmp_path, ca_key, ca_cert, IDENTITY[n]) for n in (NODE_ID, TARGET_NODE)}


def migrate(registry, target_registry, target_srv, node_pki, tokens: PlacementTokens, *, while_fenced=None):
    """The node side of one migration, then the control plane's flip (tokens) and the source's detach."""
    listener = MigrationListener(target_registry, mtls_server_context(**_files(node_pki[TARGET_NODE]))).start()
    listener.expect(Incoming("m1", CACHE_A, IDENTITY[NODE_ID], EPOCH + 1))
    fences = fences_for(registry)
    try:
        sender = MigrationSender(
            registry.get(CACHE_A).engine,
            migration_id="m1",
            cache_id=CACHE_A,
            epoch=EPOCH + 1,
            target_endpoint=listener.endpoint,
            target_node_id=IDENTITY[TARGET_NODE],
            tls_context=mtls_client_context(**_files(node_pki[NODE_ID])),
        )

        def fence():
            assert fences.fence(CACHE_A, target_srv.endpoint, EPOCH + 1)
            if while_fenced:
                while_fenced()

        stats = sender.run(fence=fence)
    finally:
        listener.stop()
    tokens.node, tokens.epoch = TARGET_NODE, EPOCH + 1  # cutover: the control plane's transaction
    fences.moved(CACHE_A, target_srv.endpoint, EPOCH + 1)
    assert registry.detach(cache_id=CACHE_A, epoch=EPOCH)
    return stats


def _files(files):
    return {"cert_file": files["cert"], "key_file": files["key"], "ca_file": files["ca"]}


def seq(i: int) -> np.ndarray:
    return (np.arange(13, dtype=np.int32) + 1000 * i) % 50_000


def test_client_putting_during_migration_loses_no_acknowledged_put(
    server, registry, target, node_pki, spec, make_token, client_ctx
):
    target_registry, target_srv = target
    tokens = PlacementTokens(make_token)
    client = DataPlaneClient(server.endpoint, tokens, CACHE_A, spec, ssl_context=client_ctx)
    acknowledged, stop, errors = [], threading.Event(), []

    def keep_writing():
        i = 0
        try:
            while not stop.is_set() or i < 40:
                tokens_i = seq(i)
                client.put(tokens_i, prefix_kv(spec, tokens_i))
                acknowledged.append(i)
                n, kv = client.get(tokens_i)
                assert n == len(tokens_i) and torch.equal(kv, prefix_kv(spec, tokens_i))
                i += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writer = threading.Thread(target=keep_writing)

    def until_a_put_is_moved():  # the fence stays up until a put of the writer was answered MOVED
        acked, moved = len(acknowledged), tokens.invalidated  # reads are still served here: only a put is refused
        eventually(lambda: tokens.invalidated > moved or not writer.is_alive(), timeout=60)
        assert tokens.invalidated > moved, f"no put was answered MOVED while the cache was fenced (60 s): {errors}"
        assert len(acknowledged) <= acked + 1  # at most the put that finished as the fence went up

    writer.start()
    try:
        eventually(lambda: len(acknowledged) >= 15 or not writer.is_alive(), timeout=60)
        assert len(acknowledged) >= 15, f"the writer acknowledged {len(acknowledged)} puts in 60 s: {errors}"
        stats = migrate(registry, target_registry, target_srv, node_pki, tokens, while_fenced=until_a_put_is_moved)
    finally:
        stop.set()
        writer.join(60)
    assert not errors and not writer.is_alive()
    assert stats.blocks_sent > 0
    assert client.endpoint == target_srv.endpoint  # the SDK followed MOVED
    fresh = DataPlaneClient(target_srv.endpoint, tokens, CACHE_A, spec, ssl_context=client_ctx)
    for i in acknowledged:
        n, kv = fresh.get(seq(i))
        assert n == 13 and torch.equal(kv, prefix_kv(spec, seq(i))), i
    target_registry.get(CACHE_A).engine.check_invariants()


def test_old_node_answers_moved_after_cutover(server, registry, target, node_pki, spec, make_token, raw, client_ctx):
    target_registry, target_srv = target
    engine = registry.get(CACHE_A).engine
    engine.put(seq(1), prefix_kv(spec, seq(1)))
    old_token = make_token(CACHE_A)
    conn = raw()
    assert conn.hello(old_token).opcode == wire.Opcode.OK
    tokens = PlacementTokens(make_token)
    migrate(registry, target_registry, target_srv, node_pki, tokens)
    reply = conn.request(wire.Opcode.LOOKUP, seq(1), identity=spec)  # an open session: MOVED
    assert reply.opcode == wire.Opcode.MOVED
    assert (reply.meta["endpoint"], reply.meta["epoch"]) == (target_srv.endpoint, EPOCH + 1)
    again = raw().hello(old_token)  # a new HELLO with a token for this cache: MOVED too
    assert again.opcode == wire.Opcode.MOVED and again.meta["epoch"] == EPOCH + 1
    client = DataPlaneClient(server.endpoint, tokens, CACHE_A, spec, ssl_context=client_ctx)
    n, kv = client.get(seq(1))  # the SDK follows MOVED to the target
    assert n == 13 and torch.equal(kv, prefix_kv(spec, seq(1)))
    assert client.endpoint == target_srv.endpoint
    assert len(bt.snapshot(target_registry.get(CACHE_A).engine)) == 4
