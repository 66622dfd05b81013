"""Crashes against the real service: the control plane (live server, PostgreSQL), its Celery worker, and node agent
PROCESSES serving TLS 1.3, driven by a hand-made wire client (tests.e2e.conftest.RawConnection) that can stop
sending in the middle of a PUT's payload.

- the agent is SIGKILLed while a PUT's payload is half sent; restarted with the same credential, it re-registers
  holding nothing, the control plane provisions the cache again (settings.KCAAS_NODE_REGISTER_RECONCILER), the cache
  is ready again, none of the cut put is visible, and a full put + get works;
- a connection that dies mid-payload (the agent alive) leaves nothing visible, while the agent keeps serving;
- a node SIGKILLed for good loses its lease: the sweep (the `caches.sweep_leases` beat task, run by the control
  worker) marks the node `lost` and its cache `failed` with reason `node_lost` (caches.services.caches_sweep_leases),
  which the tenant sees through the REST API.
"""

from __future__ import annotations

import socket
import struct
import threading
import uuid

import pytest
import torch
from celery.signals import task_postrun
from django.utils import timezone

import kcaas
from core.celery import app as control_app
from fleet.models import Node
from kcaas import wire
from kcaas.dataplane import DataPlaneClient
from kcaas.errors import KcaasError
from kcaas.wire import Opcode
from tests.e2e.conftest import (
    RawConnection,
    random_kv,
    random_tokens,
    spec_for,
    tenant_dataplane,
    tenant_key,
)
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
PUT_TOKENS = 64  # 4 full blocks of 16


def start_half_put(conn: RawConnection, client: kcaas.Client, cache, spec, tokens, kv) -> int:
    """HELLO with a real token, then a PUT of `tokens` whose header, metadata, token ids and only half of the KV are
    sent. Returns the bytes of the frame left unsent."""
    ok, _ = conn.hello(cache.id, client.issue_token(cache.id, access="readwrite").token)
    assert ok.opcode == Opcode.OK
    head, token_ids, kv_bytes = wire.encode_request(
        Opcode.PUT,
        conn.new_id() + 1,
        cache_id=cache.id,
        identity=spec,
        token_ids=[tokens.to(torch.int32).numpy()],
        kv=[kv.numpy()],
    )
    kv_bytes = memoryview(kv_bytes)
    assert kv_bytes.nbytes == PUT_TOKENS * spec.kv_bytes_per_token
    conn.send([head, token_ids, kv_bytes[: kv_bytes.nbytes // 2]])
    return kv_bytes.nbytes - kv_bytes.nbytes // 2


def _proc_address(address: tuple) -> str:
    """An IPv4 (host, port) as /proc/net/tcp writes it: the address as a native-endian 32-bit word, then the port."""
    return "%08X:%04X" % (struct.unpack("=I", socket.inet_aton(address[0]))[0], address[1])


def tcp_ends(ours: tuple, theirs: tuple) -> tuple[tuple | None, tuple | None]:
    """The kernel's view of one loopback TCP connection from /proc/net/tcp (both processes share this host): for our
    end and the agent's, (state, bytes queued to send and not yet acknowledged, bytes received and not yet read by
    the process), or None where that end no longer exists."""
    ends = {}
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            tx, rx = (int(n, 16) for n in fields[4].split(":"))
            ends[(fields[1], fields[2])] = (fields[3], tx, rx)
    mine, other = _proc_address(ours), _proc_address(theirs)
    return ends.get((mine, other)), ends.get((other, mine))


def agent_took_everything_sent(ours: tuple, theirs: tuple) -> bool:
    """Every byte we sent was acknowledged, and none waits unread at the agent's end: the agent process has read it
    all into its own buffers (whole TLS records were sent, so none is left half in OpenSSL either)."""
    mine, agents = tcp_ends(ours, theirs)
    return mine is not None and agents is not None and mine[1] == 0 and agents[2] == 0


def agent_closed_its_end(ours: tuple, theirs: tuple) -> bool:
    """The agent has closed its end (neither ESTABLISHED nor CLOSE_WAIT, or gone): it is done with the connection."""
    _, agents = tcp_ends(ours, theirs)
    return agents is None or agents[0] not in ("01", "08")


def put_and_read_back(dp: DataPlaneClient, tokens, kv) -> None:
    assert dp.put(tokens, kv)["num_cached"] == len(tokens)
    assert dp.lookup(tokens) == len(tokens)
    n, got = dp.get(tokens)
    assert n == len(tokens) and torch.equal(got, kv)


def test_sigkill_mid_put_then_restart_reprovisions_and_shows_nothing_of_the_cut_put(
    live_server, agent_launcher, pki, model
):
    spec = spec_for(model)
    agent = agent_launcher.start()
    client = kcaas.Client(live_server.url, tenant_key())
    tokens, kv = random_tokens(PUT_TOKENS, seed=21)[0], random_kv(spec, PUT_TOKENS, seed=22)
    try:
        cache = client.attach("crash", spec, {"device": 64 * spec.block_bytes}, timeout=30)
        assert cache.endpoint == agent.endpoint
        conn = RawConnection(agent.endpoint, pki)
        try:
            assert start_half_put(conn, client, cache, spec, tokens, kv) > 0
            ends = conn.sock.getsockname(), conn.sock.getpeername()
            assert eventually(lambda: agent_took_everything_sent(*ends)), "the half payload never reached the agent"
            agent.kill()
            assert agent.process.returncode == -9
            with pytest.raises(OSError):  # the killed agent's socket is gone: no answer ever comes to the cut put
                conn.read_frame()
        finally:
            conn.close()
        assert client.get_cache(cache.id).state == "ready"  # the control plane has not noticed yet (lease running)

        restarted = agent_launcher.restart(agent)  # same credential, same endpoint: it re-registers holding nothing
        assert restarted.node_id == agent.node_id and restarted.alive
        again = client.wait_for(cache.id, "ready", timeout=30)  # provisioned again on the node, same placement
        assert (again.node_id, again.endpoint, again.epoch) == (cache.node_id, cache.endpoint, cache.epoch)

        with tenant_dataplane(client, again, spec, pki) as dp:
            assert dp.hello is None and dp.lookup(tokens) == 0  # no half-written block of the cut put is visible
            assert dp.hello.node_id == str(agent.node_id) and dp.hello.epoch == cache.epoch
            n, _ = dp.get(tokens)
            assert n == 0
            put_and_read_back(dp, tokens, kv)  # and the re-provisioned cache takes a full put
    finally:
        client.close()


def test_a_connection_dying_mid_put_leaves_nothing_and_the_agent_keeps_serving(live_server, agent, pki, model):
    spec = spec_for(model)
    client = kcaas.Client(live_server.url, tenant_key())
    tokens, kv = random_tokens(PUT_TOKENS, seed=31)[0], random_kv(spec, PUT_TOKENS, seed=32)
    try:
        cache = client.attach("cut", spec, {"device": 64 * spec.block_bytes}, timeout=30)
        with tenant_dataplane(client, cache, spec, pki) as dp:
            conn = RawConnection(agent.endpoint, pki)
            try:
                start_half_put(conn, client, cache, spec, tokens, kv)
                ends = conn.sock.getsockname(), conn.sock.getpeername()
                assert eventually(lambda: agent_took_everything_sent(*ends)), "the half payload never reached the agent"
                assert dp.lookup(tokens) == 0  # a put in progress is not visible, not even its complete blocks
            finally:
                conn.close()  # the client dies: the rest of the payload never comes
            # the agent has seen the end of the stream and given the connection up: whatever it keeps of it, it keeps
            assert eventually(lambda: agent_closed_its_end(*ends)), "the agent never closed the dead connection"
            assert agent.alive
            assert dp.lookup(tokens) == 0
            n, _ = dp.get(tokens)
            assert n == 0
            with tenant_dataplane(client, cache, spec, pki) as other:  # another connection: a complete put works
                put_and_read_back(other, tokens, kv)
            n, got = dp.get(tokens)
            assert n == PUT_TOKENS and torch.equal(got, kv)
    finally:
        client.close()


def sweep(timeout: float = 20.0) -> None:
    """Run the lease sweep as beat does (the `caches.sweep_leases` task, on the control worker: a thread of this
    process) and return once the worker has run it to the end."""
    wanted, ran = str(uuid.uuid4()), threading.Event()
    states = []

    def finished(task_id=None, state=None, **kwargs) -> None:
        if task_id == wanted:
            states.append(state)
            ran.set()

    task_postrun.connect(finished, weak=False)
    try:
        control_app.send_task("caches.sweep_leases", queue="control", task_id=wanted)
        assert ran.wait(timeout), "the control worker did not run the sweep"
    finally:
        task_postrun.disconnect(finished)
    assert states == ["SUCCESS"], states


def test_a_killed_node_is_lost_after_its_lease_and_the_tenant_sees_its_cache_failed(
    live_server, agent_launcher, settings, model
):
    settings.KCAAS_NODE_HEARTBEAT_SECONDS = 1  # the live server is a thread of this process: it answers with these
    settings.KCAAS_NODE_LEASE_SECONDS = 4
    spec = spec_for(model)
    agent = agent_launcher.start()
    client = kcaas.Client(live_server.url, tenant_key())
    try:
        cache = client.attach("lease", spec, {"device": 64 * spec.block_bytes}, timeout=30)
        node = Node.objects.get(pk=agent.node_id)
        assert node.state == "ready" and node.lease_expires_at is not None

        # alive, it outlives its lease: heartbeats renew it, and a sweep run once the first lease would have run out
        # leaves the node alone (the wait is for the clock to pass that lease's end: nothing else can show it)
        first_lease_end = node.lease_expires_at
        assert eventually(lambda: timezone.now() > first_lease_end, timeout=settings.KCAAS_NODE_LEASE_SECONDS + 5)
        sweep()
        node = Node.objects.get(pk=agent.node_id)
        assert node.state == "ready" and node.lease_expires_at > first_lease_end  # renewed by heartbeats
        assert client.get_cache(cache.id).state == "ready"

        agent.kill()
        lease_end = Node.objects.get(pk=agent.node_id).lease_expires_at
        assert (lease_end - timezone.now()).total_seconds() <= settings.KCAAS_NODE_LEASE_SECONDS
        # dead, nothing renews it: once its lease has run out, one sweep marks it lost and fails its cache
        assert eventually(
            lambda: Node.objects.get(pk=agent.node_id).lease_expires_at < timezone.now(),
            timeout=settings.KCAAS_NODE_LEASE_SECONDS + 5,
        ), "the dead node's lease was still renewed"
        sweep()

        assert Node.objects.get(pk=agent.node_id).state == "lost"
        seen = client.get_cache(cache.id)  # the tenant's view, through the REST API
        assert (seen.state, seen.failure_reason) == ("failed", "node_lost")
        assert [c.id for c in client.list_caches(state="failed")] == [cache.id]
        with pytest.raises(KcaasError) as refused:  # no data token for a cache whose node is gone
            client.issue_token(cache.id, access="readwrite")
        assert (refused.value.status, refused.value.code) == (409, "cache_not_ready")
    finally:
        client.close()
