"""A cache's block events over the TLS data plane (an agent process, the live control plane): the cache's own tenant
reads, with a read-only data token, vLLM-format events of every full block its puts stored and its deletes and
evictions removed, in order, replayable from any kept seq; every block an event names as stored is served by a GET
of its tokens; another tenant's token opens only its own cache's events, never this one's."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest
import torch

import kcaas
from kcaas.events_bridge import EventsBridge, check_loopback
from kcaas.kv_events import BlockRemoved, BlockStored
from tests.e2e.conftest import client_tls, random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key
from tests.e2e.vllm_support import REPO, requires_vllm, runner_env, vllm_python
from tests.faults import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def stored_and_removed(events) -> tuple[list[BlockStored], set[bytes]]:
    stored, removed = [], set()
    for _, batch in events.batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored.append(event)
                removed -= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed |= set(event.block_hashes)
    return stored, removed


def test_a_tenant_reads_its_caches_block_events_and_no_one_elses(live_server, agent, model, pki):
    spec = spec_for(model)
    a, b = kcaas.Client(live_server.url, tenant_key()), kcaas.Client(live_server.url, tenant_key())
    cache_a = a.attach("events", spec, {"device": 24 * spec.block_bytes}, timeout=30)
    cache_b = b.attach("events", spec, {"device": 24 * spec.block_bytes}, timeout=30)
    writer = tenant_dataplane(a, cache_a, spec, pki)
    reader = tenant_dataplane(a, cache_a, spec, pki, access="read")
    other = tenant_dataplane(b, cache_b, spec, pki)
    try:
        first = random_tokens(40, seed=1)[0]  # 2 full blocks and a partial one
        second = torch.cat((first[:32], random_tokens(20, seed=2)[0]))  # shares 2 blocks, adds 1 full
        writer.put(first, random_kv(spec, 40, seed=1))
        writer.put(second, random_kv(spec, 52, seed=2))
        events = reader.events()
        assert events.first_seq == 0 and not events.missed
        stored, removed = stored_and_removed(events)
        assert not removed and all(e.block_size == spec.block_size and e.medium == "GPU" for e in stored)
        chain = [h for e in stored for h in e.block_hashes]  # one chain: 3 full blocks (the partial one is not)
        assert len(chain) == len(set(chain)) == 3 and stored[0].parent_block_hash is None
        assert [t for e in stored for t in e.token_ids] == second[:48].tolist()
        # what the events say is stored, a GET of its tokens serves
        assert writer.lookup(second[:48]) == 48 and writer.get(second[:48])[0] == 48
        assert writer.delete(second) == 5  # the prefix from its first block and all under it (partial blocks too)
        more = reader.events(events.next_seq)
        _, gone = stored_and_removed(more)
        assert gone == set(chain) and more.batches[0][0] == events.next_seq  # full blocks only have events
        replay = reader.events(0)  # nothing dropped yet: every batch again, in order
        assert [seq for seq, _ in replay.batches] == list(range(replay.next_seq))

        assert other.events().batches == ()  # B's own cache: empty, nothing of A's
        with pytest.raises(kcaas.dataplane.DataPlaneError) as refused:
            stranger = kcaas.dataplane.DataPlaneClient(
                cache_a.endpoint, kcaas.TokenSource(b, cache_b.id, "read"), cache_a.id, spec,
                ssl_context=client_tls(pki), timeout=10,
            )  # fmt: skip
            stranger.events()
        assert refused.value.code in ("not_found", "unauthenticated")
    finally:
        for client in (writer, reader, other):
            client.close()


@requires_vllm
def test_the_loopback_bridge_republishes_a_caches_events_for_vllm_event_consumers(live_server, agent, model, pki):
    spec = spec_for(model)
    client = kcaas.Client(live_server.url, tenant_key())
    cache = client.attach("bridged", spec, {"device": 24 * spec.block_bytes}, timeout=30)
    writer = tenant_dataplane(client, cache, spec, pki)
    reader = tenant_dataplane(client, cache, spec, pki, access="read")
    port = free_port()
    endpoints = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    bridge = EventsBridge(reader, *endpoints, poll_s=0.05)
    stop = threading.Event()
    running = threading.Thread(target=bridge.run, args=(stop,), daemon=True)  # its sockets are its thread's
    consumer = subprocess.Popen(
        [vllm_python(), str(REPO / "tests" / "e2e" / "vllm_events.py"), "consume", *endpoints, "2"],
        env=runner_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        running.start()
        assert json.loads(consumer.stdout.readline()) == {"ready": True}
        tokens = random_tokens(32, seed=3)[0]
        writer.put(tokens, random_kv(spec, 32, seed=3))
        first = json.loads(consumer.stdout.readline())
        writer.delete(tokens)
        second = json.loads(consumer.stdout.readline())
        assert first["seq"] == 0 and first["events"][0]["type"] == "BlockStored"
        assert first["events"][0]["token_ids"] == tokens.tolist() and len(first["events"][0]["block_hashes"]) == 2
        assert second["seq"] == 1 and second["events"][0]["type"] == "BlockRemoved"
        assert set(second["events"][0]["block_hashes"]) == set(first["events"][0]["block_hashes"])
        assert json.loads(consumer.stdout.readline()) == {"replayed": [0, 1]}  # vLLM's replay protocol
    finally:
        stop.set()
        running.join(timeout=10)
        consumer.kill()
        bridge.close()
        writer.close()
        reader.close()


def test_the_bridge_binds_only_the_loopback_unless_told():
    check_loopback("tcp://127.0.0.1:5557")
    with pytest.raises(ValueError, match="not a loopback"):
        check_loopback("tcp://0.0.0.0:5557")
