"""gpu_node.admission: per-tenant limits without blocking, exact bookkeeping, and no growth per tenant seen."""

import threading

import pytest

from gpu_node.admission import TenantAdmission, TenantLimits
from kcaas.wire import ErrorCode, ProtocolError


def refused_limit(fn, *args) -> str:
    with pytest.raises(ProtocolError) as caught:
        fn(*args)
    assert caught.value.code == ErrorCode.OVERLOADED and caught.value.details["retry_after_ms"] > 0
    return caught.value.details["limit"]


def test_each_limit_refuses_only_its_tenant_and_counts_come_back():
    refusals = []
    admission = TenantAdmission(TenantLimits(max_connections=1, max_inflight_requests=2, max_inflight_bytes=100),
                                on_refusal=refusals.append)  # fmt: skip
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


def test_concurrent_admissions_never_exceed_the_limit():
    admission = TenantAdmission(TenantLimits(max_inflight_requests=3))
    peak, lock, held = [0], threading.Lock(), [0]

    def worker():
        for _ in range(300):
            try:
                hold = admission.admit("a")
            except ProtocolError:
                continue
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
            with lock:
                held[0] -= 1
            hold.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= peak[0] <= 3
    assert admission.usage("a") == (0, 0, 0)
    admission.check_invariants()
