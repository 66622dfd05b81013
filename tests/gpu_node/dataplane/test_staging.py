"""The node's staging pool (gpu_node/dataplane/staging.py): one budget for every put's staging, reserved before anything
is allocated; buffers reused warm, zeroed before another tenant's bytes land in them, when their tenant is purged, and
when they are released to the system."""

import pytest

from gpu_node.dataplane.staging import StagingPool
from kcaas.wire import ErrorCode, ProtocolError

PAGE = 4096


def filled(lease, byte: int = 7):
    lease.view[:] = bytes([byte]) * lease.nbytes
    return lease


def test_a_tenants_own_buffer_comes_back_warm_and_another_tenant_gets_it_zeroed():
    pool = StagingPool(1 << 20)
    first = filled(pool.lease(3 * PAGE, "tenant:a"))
    memory = first._buffer.memory
    first.give_back()
    again = pool.lease(2 * PAGE, "tenant:a")
    assert again._buffer.memory is memory and bytes(again.view[:4]) == b"\x07" * 4  # warm, not zeroed: same tenant
    again.give_back()
    other = pool.lease(3 * PAGE, "tenant:b")
    assert other._buffer.memory is memory and bytes(other.view) == bytes(3 * PAGE)  # nothing of tenant a
    pool.check_invariants()


def test_the_node_budget_refuses_a_lease_that_does_not_fit_but_never_a_lone_one():
    refusals = []
    pool = StagingPool(8 * PAGE, on_refusal=refusals.append)
    held = pool.lease(6 * PAGE, "tenant:a")
    with pytest.raises(ProtocolError) as refused:
        pool.lease(4 * PAGE, "tenant:b")
    assert refused.value.code == ErrorCode.OVERLOADED and refused.value.details["limit"] == "node_bytes"
    assert refusals == ["node_bytes"] and pool.usage() == (6 * PAGE, 0)  # nothing allocated for the refusal
    held.give_back()
    alone = pool.lease(20 * PAGE, "tenant:b")  # larger than the budget, but nothing else is lent: it runs
    assert alone.nbytes == 20 * PAGE
    alone.give_back()
    pool.check_invariants()


def test_idle_buffers_make_room_and_are_zeroed_when_released():
    pool = StagingPool(8 * PAGE)
    old = filled(pool.lease(6 * PAGE, "tenant:a"))
    view = memoryview(old._buffer.memory)
    old.give_back()
    newer = pool.lease(7 * PAGE, "tenant:b")  # does not fit beside the idle one: it is released first
    assert newer._buffer.memory is not old._buffer.memory and bytes(view[: 6 * PAGE]) == bytes(6 * PAGE)
    assert pool.usage() == (7 * PAGE, 0)


def test_idle_staging_is_trimmed_after_its_time_and_a_purged_tenants_is_zeroed_now():
    now = [0.0]
    pool = StagingPool(1 << 20, idle_seconds=30, clock=lambda: now[0])
    a, b = filled(pool.lease(PAGE, "tenant:a")), filled(pool.lease(PAGE, "tenant:b"), 9)
    views = {name: memoryview(lease._buffer.memory) for name, lease in (("a", a), ("b", b))}
    a.give_back()
    b.give_back()
    assert pool.scrub_tenant("tenant:a") == 1
    assert bytes(views["a"]) == bytes(PAGE) and bytes(views["b"][:4]) == b"\x09" * 4  # only the purged tenant's
    now[0] = 31.0
    assert pool.trim() == 2 and pool.usage() == (0, 0)
    assert bytes(views["b"]) == bytes(PAGE)  # released: zeroed first
    pool.check_invariants()
