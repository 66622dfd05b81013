"""A drain under `make cluster`, as a user runs it: scripts/cluster.py with two agents on PostgreSQL and Redis (its
own database and Redis dbs 4/5, a private var/ dir, free ports), each agent with an SSD tier.

The printed tenant key attaches a cache whose device pool is smaller than what is put (the rest is demoted to the
SSD tier), KV goes in through the node's TLS 1.3 data plane, and staff drain that node through the admin API. The
cache must end ready on the other node one epoch later, every sequence coming back byte for byte from the new
node; the drained node holds no reservation, reports no cache, and its SSD root no longer has the cache's
directory, while the new node's has it (each agent has its own SSD root: a shared one made the two stores of a
migration collide). Then the drained node, left `draining`, is uncordoned back to `ready`, and Ctrl-C stops
everything.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import ssl
import time
from pathlib import Path

import pytest
import torch

import kcaas
from kcaas.dataplane import DataPlaneClient
from kcaas.tokens import TokenSource
from tests.e2e.cluster_support import SPEC, own_services, running_cluster, staff_call
from tests.e2e.up_support import REPO, assert_all_gone, reported_pids
from tests.waiting import eventually

DATABASE = f"kcaas_cluster_drain_{os.getpid()}"
REDIS_DBS = (4, 5)  # rate limits / key usage, and the Celery broker (test_make_cluster.py has 12/13)
DEVICE_BLOCKS, SSD_BLOCKS, SEQUENCES, SEQ_TOKENS = 8, 64, 6, 48  # 18 blocks put: 10+ of them only on the SSD


@pytest.fixture
def drain_services():
    """A fresh database (cluster.py creates it), empty Redis dbs, and an SSD tier on every agent."""
    with own_services(DATABASE, REDIS_DBS) as services:
        yield {**services, "KCAAS_NODE_SSD_BYTES": str(256 * SPEC.block_bytes), "KCAAS_NODE_SSD_DIR": ""}


def sequences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    shape = (SPEC.num_layers, 2, SEQ_TOKENS, SPEC.num_kv_heads, SPEC.head_dim)
    return [
        (torch.randint(0, 1000, (SEQ_TOKENS,), generator=generator), torch.randn(shape, generator=generator).half())
        for _ in range(SEQUENCES)
    ]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes()


def all_come_back(client: kcaas.Client, cache, tls: ssl.SSLContext, puts) -> bool:
    """Every sequence read back through a fresh connection to the cache's endpoint: the same bytes."""
    with DataPlaneClient(
        cache.endpoint, TokenSource(client, cache.id, access="readwrite"), cache.id, SPEC, ssl_context=tls, timeout=10.0
    ) as dp:
        for tokens, kv in puts:
            n, back = dp.get(tokens)
            assert n == SEQ_TOKENS and same_bytes(back, kv), f"{n} tokens back from {cache.endpoint}"
    return True


def ssd_roots(var_dir: Path) -> dict[str, Path]:
    """The agents' SSD roots, as scripts/up.py names them (node name -> root)."""
    return {"local-cpu": var_dir / "kcaas-ssd", "local-cpu-2": var_dir / "kcaas-ssd-2"}


def test_up_gives_every_agent_its_own_ssd_root_and_migration_listener(tmp_path, monkeypatch):
    """scripts/up.py's agent environments: no two agents share an SSD root or a migration port (given a base port,
    consecutive ones; else port 0, a free one each)."""
    spec = importlib.util.spec_from_file_location("kcaas_up_script", REPO / "scripts" / "up.py")
    up = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(up)
    boot = {
        "credentials": ["kc_node_a", "kc_node_b", "kc_node_c"],
        "tls": {"nodes": [{"cert": f"c{i}", "key": f"k{i}"} for i in range(3)]},
    }
    env = {"KCAAS_VAR_DIR": str(tmp_path), "KCAAS_NODE_SSD_DIR": "/elsewhere", "KCAAS_NODE_MIGRATION_ENDPOINT": "x:1"}
    for name in ("KCAAS_NODE_SSD_DIR", "KCAAS_NODE_MIGRATION_PORT", "KCAAS_NODE_MIGRATION_LISTEN"):
        monkeypatch.delenv(name, raising=False)
    envs = up.agent_envs(env, boot, 3, "http://127.0.0.1:8000", "127.0.0.1", 8000)
    assert [e["KCAAS_NODE_SSD_DIR"] for e in envs] == [
        str(tmp_path / "kcaas-ssd"),
        str(tmp_path / "kcaas-ssd-2"),
        str(tmp_path / "kcaas-ssd-3"),
    ]
    assert [e["KCAAS_NODE_MIGRATION_LISTEN"] for e in envs] == ["127.0.0.1:0"] * 3
    assert not any("KCAAS_NODE_MIGRATION_ENDPOINT" in e for e in envs)  # each advertises its own listener
    monkeypatch.setenv("KCAAS_NODE_MIGRATION_PORT", "9300")
    monkeypatch.setenv("KCAAS_NODE_SSD_DIR", "/data/ssd")
    envs = up.agent_envs(env, boot, 3, "http://127.0.0.1:8000", "127.0.0.1", 8000)
    assert [e["KCAAS_NODE_MIGRATION_LISTEN"] for e in envs] == ["127.0.0.1:9300", "127.0.0.1:9301", "127.0.0.1:9302"]
    assert [e["KCAAS_NODE_SSD_DIR"] for e in envs] == ["/data/ssd", "/data/ssd-2", "/data/ssd-3"]


def test_a_drain_under_make_cluster_moves_the_cache_and_uncordon_returns_the_node(tmp_path, drain_services):
    started = time.monotonic()
    with running_cluster(tmp_path, drain_services) as (cluster, banner, output, ports):
        port = ports[0]
        base = f"http://127.0.0.1:{port}"
        api_key = re.search(r"demo API key\s+(kc_live_\S+)", banner).group(1)
        password = re.search(r"admin login\s+admin / (\S+)", banner).group(1)
        tls = ssl.create_default_context(cafile=re.search(r"dev CA: ([^)\s]+)\)", banner).group(1))
        names = {node["id"]: node["name"] for node in staff_call(f"{base}/api/v1/admin/nodes", password)["results"]}
        roots = ssd_roots(tmp_path / "var")
        for name, root in roots.items():
            assert f"SSD {root}" in banner, name
        pids = reported_pids(banner, agents=2)
        puts = sequences()
        with kcaas.Client(base, api_key) as client:
            cache = client.attach(
                "moving",
                SPEC,
                {"device": DEVICE_BLOCKS * SPEC.block_bytes, "ssd": SSD_BLOCKS * SPEC.block_bytes},
                timeout=60,
            )
            source = cache.node_id
            with DataPlaneClient(
                cache.endpoint,
                TokenSource(client, cache.id, access="readwrite"),
                cache.id,
                SPEC,
                ssl_context=tls,
                timeout=10.0,
            ) as dp:
                for tokens, kv in puts:
                    assert dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS
            assert all_come_back(client, cache, tls, puts)  # from the device and, promoted, from the SSD

            drained = staff_call(f"{base}/api/v1/admin/nodes/{source}/drain", password, "POST")
            assert [m["cache_id"] for m in drained["migrations"]] == [cache.id]
            assert eventually(lambda: (c := client.get_cache(cache.id)).node_id != source and c.is_ready, timeout=60)
            moved = client.get_cache(cache.id)
            assert moved.epoch == cache.epoch + 1 and moved.endpoint != cache.endpoint
            assert all_come_back(client, moved, tls, puts)  # byte for byte, from the new node

            source_root, target_root = roots[names[source]], roots[names[moved.node_id]]
            node_url = f"{base}/api/v1/admin/nodes/{source}"

            def drained_node_is_empty() -> bool:
                node = staff_call(node_url, password)
                return (
                    node["state"] == "draining"
                    and node["reserved"]["device"] == 0
                    and not (node["resident"] or {}).get("caches")
                    and not (source_root / cache.id).exists()
                )

            assert eventually(drained_node_is_empty, timeout=30)
            assert (target_root / cache.id).is_dir()  # the target's own root holds the moved cache's SSD tier
            uncordoned = staff_call(f"{node_url}/uncordon", password, "POST")
            assert uncordoned["state"] == "ready"  # a drained node goes back into service
            assert staff_call(node_url, password)["state"] == "ready"
            assert client.get_cache(cache.id).is_ready
        cluster.send_signal(signal.SIGINT)
        assert cluster.wait(timeout=60) == 0
        assert eventually(lambda: "stopped" in "".join(output), timeout=5)
        assert_all_gone(pids)
    print(f"make cluster drain test: {time.monotonic() - started:.1f} s")
