"""Placement and lease sweeps under real concurrency: threads with their own PostgreSQL connections."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from fleet import services
from fleet.errors import NoCapacity
from fleet.models import Node

from .conftest import GIB, capacity_body

pytestmark = pytest.mark.django_db(transaction=True)


def _run_threads(count, target):
    """Start `count` threads on `target(i)` behind a barrier; each closes its own connection. Returns results."""
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def run(i):
        try:
            barrier.wait()
            results[i] = target(i)
        except Exception as exc:  # noqa: BLE001 - reported to the test below
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_concurrent_placements_never_over_reserve(make_node):
    for name in ("a", "b", "c"):
        make_node(name, device=8 * GIB, dram=16 * GIB)
    results = _run_threads(16, lambda i: services.node_place(capacity={"device": 2 * GIB, "dram": GIB}).pk)

    placed = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(r, NoCapacity) for r in refused), refused
    assert len(placed) == 12 and len(refused) == 4  # exactly 4 caches of 2 GiB fit each 8 GiB node
    for node in Node.objects.all():
        assert node.device_reserved_bytes == 2 * GIB * placed.count(node.pk) == 8 * GIB
        assert node.dram_reserved_bytes == GIB * placed.count(node.pk)


def test_concurrent_mixed_sizes_stay_within_capacity(make_node):
    for name, device in (("a", 7 * GIB), ("b", 11 * GIB), ("c", 5 * GIB)):
        make_node(name, device=device)
    sizes = [(i % 4 + 1) * GIB for i in range(20)]  # 50 GiB asked of 23 GiB

    def place(i):
        node = services.node_place(capacity={"device": sizes[i]})
        return node.pk, sizes[i]

    results = _run_threads(len(sizes), place)
    placed = [r for r in results if isinstance(r, tuple)]
    assert all(isinstance(r, NoCapacity | tuple) for r in results), results
    for node in Node.objects.all():
        granted = sum(size for pk, size in placed if pk == node.pk)
        assert node.device_reserved_bytes == granted <= node.device_capacity_bytes
    # Free bytes only shrink here, so a request refused at some instant does not fit anywhere at the end either:
    # a refusal always means that no node had the room, never that a lock hid it.
    largest_hole = max(node.free["device"] for node in Node.objects.all())
    for result, size in zip(results, sizes):
        if isinstance(result, NoCapacity):
            assert size > largest_hole


def _wait_until_blocked_on_a_lock(timeout=10.0):
    """Poll pg_stat_activity until some other backend waits on a lock (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # statistics views are frozen within a transaction
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                " AND datname = current_database()"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.01)
    raise AssertionError("no placement blocked on the node lock")


def test_placement_waits_for_a_concurrent_cordon_and_then_skips_the_node(make_node):
    tight = make_node("tight", device=10 * GIB)
    roomy = make_node("roomy", device=50 * GIB)
    result: dict = {}

    def placer():
        try:
            result["pk"] = services.node_place(capacity={"device": GIB}).pk
        finally:
            connections.close_all()

    with transaction.atomic():
        services.node_cordon(node_id=tight.node.pk)  # holds tight's row lock until this block commits
        thread = threading.Thread(target=placer)
        thread.start()
        _wait_until_blocked_on_a_lock()
    thread.join(timeout=30)
    assert result["pk"] == roomy.node.pk  # re-checked after the lock: tight is cordoned now
    assert Node.objects.get(pk=tight.node.pk).device_reserved_bytes == 0


def test_a_heartbeat_committing_during_the_sweep_keeps_the_node(make_node):
    t0 = timezone.now()
    handle = make_node("n1", device=GIB, now=t0)  # lease until t0 + 40 s
    result: dict = {}

    def sweeper():
        try:
            result["lost"] = services.nodes_expire_leases(now=t0 + timedelta(seconds=45))
        finally:
            connections.close_all()

    with transaction.atomic():
        services.node_heartbeat(node_id=handle.node.pk, capacity=capacity_body(), now=t0 + timedelta(seconds=30))
        thread = threading.Thread(target=sweeper)
        thread.start()
        _wait_until_blocked_on_a_lock()  # the sweep saw the old lease and waits for the heartbeat's row lock
    thread.join(timeout=30)
    assert result["lost"] == []  # re-checked against the renewed lease (t0 + 70 s)
    assert Node.objects.get(pk=handle.node.pk).state == "ready"
