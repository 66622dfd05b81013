"""gpu_node.dataplane.admission: per-tenant limits without blocking, exact bookkeeping, and no growth per tenant
seen."""

import threading

import pytest

from gpu_node.dataplane.admission import TenantAdmission, TenantLimits
from kcaas.wire import ErrorCode, ProtocolError


def refused_limit(fn, *args) -> str:
    with pytest.raises(ProtocolError) as caught:
        fn(*args)
    assert caught.value.code == ErrorCode.OVERLOADED and caught.value.details["retry_after_ms"] > 0
    return caught.value.details["limit"]


def test_each_limit_refuses_only_its_tenant_and_counts_come_back():
    refusals = []
    admission = TenantAdmission(
        TenantLimits(max_connections=1, max_inflight_requests=2, max_inflight_bytes=100), on_refusal=refusals.append
    )
    admission.connect("a")
    assert refused_limit(admission.connect, "a") == "connections"
    admission.connect("b")  # another tenant is untouched
    first = admission.admit("a", 60)
    assert refused_limit(admission.admit, "a", 41) == "bytes"
    second = admission.admit("a", 40)
    assert refused_limit(admission.admit, "a", 0) == "requests"
    assert admission.usage("a") == (1, 2, 100)
    assert refusals == ["connections", "bytes", "requests"]
    first.release()
    first.release()  # idempotent
    second.release()
    admission.disconnect("a")
    admission.disconnect("b")
    assert admission.usage("a") == (0, 0, 0)
    assert admission._usage == {}  # idle tenants leave no entry behind
    admission.check_invariants()


def test_a_lone_request_runs_whatever_the_byte_budget_and_grow_is_checked():
    admission = TenantAdmission(TenantLimits(max_inflight_bytes=10))
    big = admission.admit("a", 1000)  # alone: admitted (the frame limit bounds it)
    big.grow(5000)  # still alone: a get's answer may grow it
    assert refused_limit(admission.admit, "a", 1) == "bytes"  # but nothing else of the tenant's gets bytes
    small = admission.admit("b", 5)  # another tenant's budget is its own
    big.release()
    empty = admission.admit("b", 0)
    small.grow(5)  # b: 10 of 10
    assert refused_limit(small.grow, 1) == "bytes"  # not alone (empty is in flight): checked
    assert admission.usage("b") == (0, 2, 10)
    empty.release()
    small.release()
    assert admission.usage("a") == (0, 0, 0) and admission.usage("b") == (0, 0, 0)


def test_concurrent_admissions_admit_exactly_the_limit_and_refuse_the_rest():
    """More admissions than the limit attempted at once while those admitted are held: exactly the limit's worth
    get a slot, every other one is refused `requests`, and the counters come back to zero once they are released.
    Repeated so the attempts race on the lock in varied interleavings."""
    limit, workers, rounds = 3, 8, 50
    refusals = []
    admission = TenantAdmission(TenantLimits(max_inflight_requests=limit), on_refusal=refusals.append)
    start = threading.Barrier(workers + 1, timeout=10)  # every worker attempts at once, after the last round's checks
    attempted = threading.Barrier(workers + 1, timeout=10)  # every attempt made, the admitted ones still held
    released = threading.Barrier(workers + 1, timeout=10)
    outcomes: list[str] = []
    outcomes_lock = threading.Lock()
    failures = []

    def worker():
        try:
            for _ in range(rounds):
                start.wait()
                try:
                    hold, outcome = admission.admit("a"), "admitted"
                except ProtocolError as refused:
                    hold, outcome = None, refused.details["limit"]
                with outcomes_lock:
                    outcomes.append(outcome)
                attempted.wait()  # held across the barrier: no slot comes back before every attempt is made
                attempted.wait()  # the main thread has counted
                if hold is not None:
                    hold.release()
                released.wait()
        except Exception as error:  # noqa: BLE001 - asserted by the main thread; breaking the barriers frees it
            failures.append(error)
            for barrier in (start, attempted, released):
                barrier.abort()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        for round_ in range(rounds):
            start.wait()
            attempted.wait()
            with outcomes_lock:
                seen, outcomes[:] = sorted(outcomes), []
            assert seen == ["admitted"] * limit + ["requests"] * (workers - limit), (round_, seen)
            assert admission.usage("a") == (0, limit, 0)
            attempted.wait()
            released.wait()
            assert admission.usage("a") == (0, 0, 0), round_
            admission.check_invariants()
    except threading.BrokenBarrierError:
        pass  # a worker failed and broke the barriers: its error is asserted below
    except BaseException:
        for barrier in (start, attempted, released):
            barrier.abort()  # the workers stop at once instead of at their barrier timeout
        raise
    finally:
        for t in threads:
            t.join(10)
    assert not failures
    assert refusals == ["requests"] * ((workers - limit) * rounds)
    assert admission._usage == {}
