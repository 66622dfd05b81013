"""Where the vLLM connector's I/O threads run (kcaas/connectors/io_threads.py): the CPUs vLLM's OpenMP binding leaves
out, read from the environment vLLM gives its worker in each of its three forms, or the configured list; and a
bound thread is bound alone (the thread that started it keeps its own CPUs)."""

import os
import threading

import pytest

from kcaas.connectors.io_threads import bind_current_thread, io_cpus, omp_bound_cpus, parse_cpu_list
from kcaas.connectors.vllm_session import ConnectorConfig, ConnectorSetupError


def test_cpu_lists_in_every_form_vllm_and_openmp_write():
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("0 1 2") == {0, 1, 2}
    assert parse_cpu_list("{0,1,2}") == {0, 1, 2}
    assert parse_cpu_list("0-6:2") == {0, 2, 4, 6}
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list("cores")


def test_the_cpus_left_out_of_vllms_openmp_binding():
    assert omp_bound_cpus({"GOMP_CPU_AFFINITY": "0 1 2"}) == {0, 1, 2}  # GNU OpenMP
    assert omp_bound_cpus({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}) == {0, 1}
    assert omp_bound_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,2]"}) == {0, 2}  # Intel OpenMP
    assert omp_bound_cpus({"OMP_PLACES": "cores"}) == set()  # not a list: nothing known, nothing moved
    assert omp_bound_cpus({}) == set()
    assert io_cpus(None, {"GOMP_CPU_AFFINITY": "0 1 2"}, online=4) == {3}
    assert io_cpus(None, {"GOMP_CPU_AFFINITY": "0-3"}, online=4) == set()  # none left out: threads stay put
    assert io_cpus(None, {}, online=4) == set()
    assert io_cpus("2-3", {"GOMP_CPU_AFFINITY": "0"}, online=4) == {2, 3}  # configured wins


def test_io_cpus_in_the_connectors_config_is_checked_at_start_up():
    base = {"kcaas_url": "http://127.0.0.1:1", "cache": "chat"}
    assert ConnectorConfig.from_extra({**base, "io_cpus": "3"}, "kv_both").io_cpus == "3"
    assert ConnectorConfig.from_extra(base, "kv_both").io_cpus is None
    for bad in ("cores", ""):
        with pytest.raises(ConnectorSetupError, match="io_cpus must be a CPU list"):
            ConnectorConfig.from_extra({**base, "io_cpus": bad}, "kv_both")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_bound_thread_is_bound_alone():
    mine = os.sched_getaffinity(0)
    target = {min(mine)}
    seen: list[set[int]] = []

    def run() -> None:
        bind_current_thread(target)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [target]
    assert os.sched_getaffinity(0) == mine
