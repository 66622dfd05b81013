"""A cache that failed with its node lost keeps no blocks on that node's disk once detached: real agent processes
(python -m gpu_node.agent, SSD tier on a temporary directory) against the live control plane. The node dies
(SIGKILL), the lease sweep fails its cache (`node_lost`), the tenant detaches it; when the node's agent starts again,
its registration answer no longer lists the cache among those it may store, and the agent deletes that cache's SSD
directory. A warm restart (the node back before it is declared lost) keeps the directories of the caches still
placed on it: the cache is provisioned again with the same id and epoch, and its SSD blocks are served again."""

from __future__ import annotations

import json
from datetime import timedelta

import numpy as np
import pytest
from django.utils import timezone

from caches.services import caches_sweep_leases
from core.celery import app as control_app
from devtools.dev_pki import write_dev_pki
from fleet.models import Node
from kcaas.dataplane import DataPlaneClient
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import BLOCK_BYTES, SPEC, attach_body, running_workers, wait_for_state
from tests.e2e.conftest import AgentLauncher, client_tls
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
LAYOUT = KVCacheSpec.from_dict(SPEC)
SEQ_TOKENS = 4 * LAYOUT.block_size


@pytest.fixture
def launcher(live_server, tmp_path, monkeypatch):
    (tmp_path / "pki").mkdir()
    pki = write_dev_pki(tmp_path / "pki", server_name="ssd node")
    monkeypatch.setenv("KCAAS_NODE_SSD_DIR", str(tmp_path / "ssd"))
    monkeypatch.setenv("KCAAS_NODE_SSD_BYTES", str(1024 * BLOCK_BYTES))
    with running_workers((control_app, ["control"])):
        agents = AgentLauncher(live_server.url, pki, 256 * BLOCK_BYTES, tmp_path)
        try:
            yield agents
        finally:
            agents.close()


def attach_ready(tenant, name: str, **capacity) -> dict:
    response = tenant.client.post("/api/v1/caches", attach_body(name, **capacity), format="json")
    assert response.status_code == 201, response.content
    return wait_for_state(tenant.client, response.json()["id"], "ready", timeout=30)


def indexed_blocks(directory) -> int:
    try:
        return len(json.loads((directory / "index.json").read_text())["entries"])
    except (OSError, ValueError):
        return 0


def data_plane(tenant, cache: dict, pki) -> DataPlaneClient:
    token = tenant.client.post(f"/api/v1/caches/{cache['id']}/tokens", {"access": "readwrite"}, format="json")
    return DataPlaneClient(
        cache["endpoint"], token.json()["token"], cache["id"], LAYOUT, ssl_context=client_tls(pki), timeout=20
    )


def kv_of(seed: int):
    import torch

    shape = (LAYOUT.num_layers, 2, SEQ_TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def test_a_lost_caches_ssd_directory_is_deleted_when_its_node_returns(launcher, tenant_a, tmp_path):
    ssd = tmp_path / "ssd"
    agent = launcher.start()
    lost = attach_ready(tenant_a, "lost", device=8 * BLOCK_BYTES, ssd=64 * BLOCK_BYTES)
    assert (ssd / lost["id"]).is_dir()
    agent.kill()
    Node.objects.filter(pk=agent.node_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    caches_sweep_leases()
    assert tenant_a.client.get(f"/api/v1/caches/{lost['id']}").json()["failure_reason"] == "node_lost"
    assert tenant_a.client.delete(f"/api/v1/caches/{lost['id']}").json()["state"] == "detached"

    agent = launcher.restart(agent)  # registered (lost -> ready) before it prints "ready"
    assert Node.objects.get(pk=agent.node_id).state == "ready"
    assert not (ssd / lost["id"]).exists(), "the detached cache's blocks are still on the node's disk"


def test_a_warm_restart_keeps_the_ssd_blocks_of_the_caches_still_placed(launcher, tenant_a, tmp_path):
    ssd = tmp_path / "ssd"
    agent = launcher.start()
    kept = attach_ready(tenant_a, "kept", device=8 * BLOCK_BYTES, ssd=256 * BLOCK_BYTES)
    sequences = [(np.arange(1000 * s, 1000 * s + SEQ_TOKENS, dtype=np.int32), kv_of(s)) for s in range(4)]
    with data_plane(tenant_a, kept, launcher.pki) as dp:
        for tokens, kv in sequences:
            assert dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS
    assert eventually(lambda: indexed_blocks(ssd / kept["id"]) >= 8)  # the first two sequences went to SSD
    agent.kill()

    launcher.restart(agent)  # before any sweep: the node was never declared lost
    again = wait_for_state(tenant_a.client, kept["id"], "ready", timeout=30)
    assert (again["epoch"], again["endpoint"]) == (kept["epoch"], kept["endpoint"])
    with data_plane(tenant_a, again, launcher.pki) as dp:
        for tokens, kv in sequences[:2]:
            assert dp.lookup(tokens) == SEQ_TOKENS  # rescanned from the directory the restart kept
            n, got = dp.get(tokens)
            assert n == SEQ_TOKENS and got.equal(kv)
