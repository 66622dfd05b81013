"""Warm restart against the real service: an agent process whose cache spilled blocks to its SSD tier is SIGKILLed;
restarted with the same credential it re-registers, the control plane provisions the cache again (same id, epoch,
hash key and SSD data key), the node rescans the cache's SSD directory and serves those blocks without recompute."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import kcaas
from tests.e2e.conftest import random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
SEQ_TOKENS = 64  # 4 full blocks of 16


def distinct_tokens(seed: int) -> torch.Tensor:
    """Random tokens whose first token no other seed of a test shares (seed = 1000 * client + round, round < 12):
    prompts that share leading tokens share their KV by design, which random per-seed KV would read as wrong."""
    tokens = random_tokens(SEQ_TOKENS, seed=seed)[0]
    tokens[0] = (seed // 1000) * 12 + seed % 1000
    return tokens


def indexed_blocks(directory) -> int:
    try:
        return len(json.loads((directory / "index.json").read_text())["entries"])
    except (OSError, ValueError):
        return 0


def test_sigkill_then_restart_serves_the_ssd_blocks_again(
    live_server, agent_launcher, pki, model, tmp_path, monkeypatch
):
    spec = spec_for(model)
    ssd_root = tmp_path / "ssd"
    monkeypatch.setenv("KCAAS_NODE_SSD_DIR", str(ssd_root))
    monkeypatch.setenv("KCAAS_NODE_SSD_BYTES", str(1024 * spec.block_bytes))
    agent = agent_launcher.start()
    client = kcaas.Client(live_server.url, tenant_key())
    sequences = [(random_tokens(SEQ_TOKENS, seed=s)[0], random_kv(spec, SEQ_TOKENS, seed=s + 100)) for s in range(4)]
    try:
        cache = client.attach("warm", spec, {"device": 8 * spec.block_bytes, "ssd": 256 * spec.block_bytes}, timeout=30)
        with tenant_dataplane(client, cache, spec, pki) as dp:
            for tokens, kv in sequences:
                assert dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS
        directory = ssd_root / cache.id
        assert eventually(lambda: indexed_blocks(directory) >= 8)  # the first two sequences were evicted
        agent.kill()
        restarted = agent_launcher.restart(agent)
        again = client.wait_for(cache.id, "ready", timeout=30)
        assert (again.endpoint, again.epoch) == (cache.endpoint, cache.epoch) and restarted.alive
        with tenant_dataplane(client, again, spec, pki) as dp:
            for tokens, kv in sequences[:2]:
                assert dp.lookup(tokens) == SEQ_TOKENS
                n, got = dp.get(tokens)
                assert n == SEQ_TOKENS and torch.equal(got, kv)  # served from SSD, no recompute
    finally:
        client.close()


def test_four_clients_putting_and_deleting_on_an_ssd_cache_never_fail_and_what_stays_is_served(
    live_server, agent_launcher, pki, model, tmp_path, monkeypatch
):
    """Deletes commit the SSD index while the SSD writer commits after its batches, and neither may lose the other's
    file. Four clients put and delete at once against a real agent: no call fails, a deleted prefix is a miss, a
    kept one is exact, and a restart finds exactly the kept ones on the SSD."""
    spec = spec_for(model)
    ssd_root = tmp_path / "ssd"
    monkeypatch.setenv("KCAAS_NODE_SSD_DIR", str(ssd_root))
    monkeypatch.setenv("KCAAS_NODE_SSD_BYTES", str(4096 * spec.block_bytes))
    agent = agent_launcher.start()
    client = kcaas.Client(live_server.url, tenant_key())
    capacity = {"device": 32 * spec.block_bytes, "ssd": 1024 * spec.block_bytes}  # a small device tier: blocks spill
    try:
        cache = client.attach("busy", spec, capacity, timeout=30)
        errors: list[BaseException] = []
        kept: dict[int, tuple] = {}
        lock = threading.Lock()

        def worker(index: int) -> None:
            with tenant_dataplane(client, cache, spec, pki, timeout=20.0) as dp:
                for round_ in range(12):
                    seed = 1000 * index + round_
                    tokens, kv = distinct_tokens(seed), random_kv(spec, SEQ_TOKENS, seed=seed + 7)
                    try:
                        assert dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS
                        if round_ % 2:
                            assert dp.delete(tokens) >= 1
                            assert dp.lookup(tokens) == 0
                        else:
                            with lock:
                                kept[seed] = (tokens, kv)
                    except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                        errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, [repr(e) for e in errors]
        directory = ssd_root / cache.id
        # the 64 kept blocks the device cannot hold are on the SSD before the kill
        assert eventually(lambda: indexed_blocks(directory) >= 64, timeout=30)

        agent.kill()
        agent_launcher.restart(agent)
        again = client.wait_for(cache.id, "ready", timeout=30)
        with tenant_dataplane(client, again, spec, pki, access="read") as dp:
            served = 0
            for seed, (tokens, kv) in kept.items():
                n, got = dp.get(tokens)
                assert n in (0, SEQ_TOKENS), seed  # the device tier's blocks died with the agent; SSD ones stay
                if n:
                    assert torch.equal(got, kv), seed
                    served += 1
            assert served >= len(kept) // 2  # 32 device blocks held at most 8 of the 24 kept prefixes
            for index in range(4):
                for round_ in range(1, 12, 2):  # every deleted prefix stays deleted after the restart
                    assert dp.lookup(distinct_tokens(1000 * index + round_)) == 0
    finally:
        client.close()
