"""Where a connector's I/O threads run (no vLLM import): on the CPUs the engine's compute threads are not bound to.

vLLM's CPU build binds its OpenMP threads to cores through the environment it gives the worker (GOMP_CPU_AFFINITY,
or OMP_PLACES with OMP_PROC_BIND, or KMP_AFFINITY's proclist with Intel OpenMP), and the worker's main thread is
bound to the first of them. A thread that thread starts inherits that binding: without a binding of its own, the
connector's loader, copier and saver threads would share the forward's core and overlap nothing. vLLM reserves a
core per worker for a KV connector's transfers (the NIXL connector binds its own to the last core of each NUMA
node); KCaaS's threads take the CPUs left out of the OpenMP binding, or `io_cpus` from the connector's config.
Off Linux, or where no CPU is left out, threads keep the binding they inherit.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

logger = logging.getLogger("kcaas.connectors.vllm")


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a list such as "0-3,6", "0 1 2", "{0,1,2}" or "0-6:2" (a range with a stride).
    Raises ValueError for anything else."""
    cpus: set[int] = set()
    for part in re.split(r"[\s,]+", text.strip().strip("{}[]")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if match is None:
            raise ValueError(f"not a CPU list: {text!r}")
        first, last, stride = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
        cpus.update(range(first, last + 1, stride))
    return cpus


def omp_bound_cpus(environ: Mapping[str, str] = os.environ) -> set[int]:
    """The CPUs the process's OpenMP threads are bound to, from the environment vLLM sets; empty if none is set."""
    kmp = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
    for text in (environ.get("GOMP_CPU_AFFINITY"), environ.get("OMP_PLACES"), kmp[1] if kmp else None):
        if text:
            try:
                return parse_cpu_list(text)
            except ValueError:
                return set()  # a form we do not read (e.g. OMP_PLACES=cores): leave the threads as they are
    return set()


def io_cpus(configured: str | None, environ: Mapping[str, str] = os.environ, online: int | None = None) -> set[int]:
    """The CPUs for the connector's I/O threads: `configured` (a CPU list) if given, else the online CPUs left out
    of the OpenMP binding; empty means "leave them as they are". Raises ValueError for a bad `configured`."""
    if configured:
        return parse_cpu_list(configured)
    bound = omp_bound_cpus(environ)
    if not bound:
        return set()
    return set(range(online or os.cpu_count() or 1)) - bound


def bind_current_thread(cpus: set[int]) -> None:
    """Bind the calling thread to `cpus` (nothing when empty, or where the platform cannot); a refusal is logged."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread
    except OSError as exc:
        logger.warning("KCaaS connector: cannot bind its I/O thread to CPUs %s (%s)", sorted(cpus), exc)
