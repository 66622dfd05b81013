"""bench.dataplane's sweeps: throughput by request length, by operation size against Redis, by concurrent clients
(with the node's CPU seconds per GB), and one node process against two on pinned cores.

Each sweep interleaves its contenders round by round and keeps the median, as the headline contenders do: the
machines this runs on are shared and noisy, so read the ratios, measured side by side in one run.
"""

from __future__ import annotations

import os
import statistics
import time

MIB = 1 << 20


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def size_label(num_bytes: int) -> str:
    return f"{num_bytes // MIB}MiB" if num_bytes >= MIB else f"{num_bytes >> 10}KiB"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _kv(spec, num_tokens: int, seed: int):
    import torch

    kv = torch.empty((spec.num_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim), dtype=torch.float16)
    kv.view(torch.int16).random_(-20000, 20000, generator=torch.Generator().manual_seed(seed))
    return kv


def _ids(base: int, num_tokens: int):
    import numpy as np

    return np.arange(base, base + num_tokens, dtype=np.int32)


# ---- by request length ----------------------------------------------------------------------------------------------
def by_tokens(client, spec, lengths: list[int], rounds: int) -> dict:
    """put (fresh tokens each time) and get (into one reused, touched buffer) of one sequence of each length, over
    the client's transport; every length gets its own contiguous KV, made outside the timing."""
    import torch

    out = torch.zeros(max(lengths) * spec.elements_per_token, dtype=torch.float16)
    put, get = {n: [] for n in lengths}, {n: [] for n in lengths}
    base = 50_000_000
    for round_index in range(rounds):
        for n in lengths:
            kv = _kv(spec, n, seed=n + round_index)
            ids = _ids(base, n)
            base += n + 1
            put[n].append(gbps(kv.numel() * 2, _timed(lambda: _expect(client.put(ids, kv)["num_cached"], n))))
            got = []
            get[n].append(gbps(kv.numel() * 2, _timed(lambda: got.append(client.get(ids, out=out)))))
            same = torch.equal(got[0][1].view(torch.int16), kv.view(torch.int16))  # bits: random ones hold NaNs
            assert got[0][0] == n and same, f"get of {n} tokens returned other bytes"
            client.delete(ids)
            kv = got = None  # freed before the next round allocates (not del: the timed closures name them)
    return {
        "put_gbps_by_tokens": {str(n): statistics.median(v) for n, v in put.items()},
        "get_gbps_by_tokens": {str(n): statistics.median(v) for n, v in get.items()},
    }


def _expect(got, want) -> None:
    if got != want:
        raise RuntimeError(f"expected {want}, got {got}")


# ---- by operation size, against Redis -------------------------------------------------------------------------------
def by_size(client, redis, spec, sizes: list[int], rounds: int, budget_s: float) -> dict:
    """KCaaS UDS get/put of one sequence of each size against Redis GET/SET of one value of that size (a private
    server on a Unix socket, redis-py with hiredis). Like for like: both gets return a freshly allocated result
    (Redis cannot read into a caller's buffer; the KCaaS get into a reused `out` is reported beside it)."""
    import torch

    per_token = spec.kv_bytes_per_token
    rows = {}
    for index, size in enumerate(sizes):
        n = max(1, size // per_token)
        kv = _kv(spec, n, seed=index)
        ids = _ids(80_000_000 + index * 1_000_000, n)
        value = kv.view(torch.uint8).reshape(-1).numpy().tobytes()
        key = f"kcaas-bench:{os.getpid()}:{index}"
        client.put(ids, kv)
        redis.set(key, value)
        out = torch.zeros(n * spec.elements_per_token, dtype=torch.float16)
        reps = max(3, min(2000, int(budget_s * 2e9 / max(size, 1) / 40)))
        put_ids = [_ids(90_000_000 + index * 1_000_000 + r * (n + 1), n) for r in range(reps)]

        def kcaas_get():
            return _timed(lambda: [client.get(ids) for _ in range(reps)])

        def kcaas_get_out():
            return _timed(lambda: [client.get(ids, out=out) for _ in range(reps)])

        def redis_get():
            return _timed(lambda: [redis.get(key) for _ in range(reps)])

        def kcaas_put():
            seconds = _timed(lambda: [client.put(p, kv) for p in put_ids])
            client.delete_batch(put_ids)
            return seconds

        def redis_set():
            return _timed(lambda: [redis.set(key + ":w", value) for _ in range(reps)])

        times = _median_rounds(
            {
                "get": kcaas_get,
                "get_out": kcaas_get_out,
                "redis_get": redis_get,
                "put": kcaas_put,
                "redis_set": redis_set,
            },
            rounds,
        )
        rows[size_label(size)] = {name: seconds / reps * 1e6 for name, seconds in times.items()}  # us per operation
        redis.delete(key, key + ":w")
        client.delete(ids)
    return {
        "by_size_us": rows,
        "get_vs_redis_by_size": {label: row["redis_get"] / row["get"] for label, row in rows.items()},
        "get_out_vs_redis_by_size": {label: row["redis_get"] / row["get_out"] for label, row in rows.items()},
        "put_vs_redis_by_size": {label: row["redis_set"] / row["put"] for label, row in rows.items()},
    }


def _median_rounds(contenders: dict, rounds: int) -> dict[str, float]:
    values: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds + 1):  # the first round warms up
        for name, fn in contenders.items():
            value = fn()
            if index:
                values[name].append(value)
    return {name: statistics.median(v) for name, v in values.items()}


# ---- concurrent clients ---------------------------------------------------------------------------------------------
def client_worker(conn, uds_path: str, token: str, cache_id: str, spec_fields: dict, sequences: list, cpus) -> None:
    """A client process: on ("run", seconds) it gets its sequences round robin (into one reused out) for that long
    and answers the bytes it received; on "stop" it leaves."""
    import numpy as np
    import torch

    from bench._dataplane_node import spec_from
    from kcaas.dataplane import DataPlaneClient

    if cpus:
        os.sched_setaffinity(0, set(cpus))
    spec = spec_from(spec_fields)
    client = DataPlaneClient(None, token, cache_id, spec, uds_path=uds_path)
    ids = [np.asarray(s, dtype=np.int32) for s in sequences]
    out = torch.zeros(max(len(s) for s in ids) * spec.elements_per_token, dtype=torch.float16)
    client.get(ids[0], out=out)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "stop":
            break
        received, deadline, index = 0, time.perf_counter() + command[1], 0
        while time.perf_counter() < deadline:
            n, _ = client.get(ids[index % len(ids)], out=out)
            received += n * spec.kv_bytes_per_token
            index += 1
        conn.send(received)
    client.close()


class Clients:
    """Client processes (spawned once, reused by every measurement)."""

    def __init__(self, ctx, specs: list[tuple]):
        self.pipes, self.processes = [], []
        for args in specs:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=client_worker, args=(child, *args), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        for pipe in self.pipes:
            if not pipe.poll(180):
                raise SystemExit("bench.dataplane: a client process did not start within 180 s")
            pipe.recv()

    def run(self, indexes: list[int], seconds: float) -> int:
        for i in indexes:
            self.pipes[i].send(("run", seconds))
        return sum(self.pipes[i].recv() for i in indexes)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send("stop")
            except (OSError, BrokenPipeError):
                pass
        for process in self.processes:
            process.join(10)


def by_clients(clients: Clients, node, counts: list[int], seconds: float, rounds: int) -> dict:
    """Aggregate GET throughput of 1..N concurrent client processes on one node, and the node's CPU seconds per GB
    served: with one process and threads that release the GIL for the copies and the crypto, that cost must not
    grow with clients (on these 2-core machines the clients share the cores, so aggregate throughput cannot grow)."""
    rate, cost = {n: [] for n in counts}, {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            cpu = node.cpu_seconds()
            received = clients.run(list(range(n)), seconds)
            cpu = node.cpu_seconds() - cpu
            rate[n].append(received / seconds / 1e9)
            cost[n].append(cpu / (received / 1e9) if received else float("nan"))
    return {
        "get_gbps_by_clients": {str(n): statistics.median(v) for n, v in rate.items()},
        "server_cpu_s_per_gb_by_clients": {str(n): statistics.median(v) for n, v in cost.items()},
    }


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (threads started later inherit their creator's: the accept loops')."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass


def processes_vs_one(
    clients: Clients, one, two, pair_in_one: list[int], pair_in_two: list[int], seconds: float, rounds: int
) -> dict:
    """Two client processes, each on its own cache: both caches in one node process pinned to one core, against each
    cache in its own node process pinned to its own core (and one node process allowed both cores: its threads)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"two_procs_vs_one": None, "one_proc_two_cores_vs_one": None, "pinning": "fewer than 2 cores"}
    first, second = {cpus[0]}, {cpus[1]}
    values = {"one_core": [], "two_procs": [], "one_proc_two_cores": []}
    for _ in range(rounds):
        pin(one.info["pid"], first)
        values["one_core"].append(clients.run(pair_in_one, seconds) / seconds / 1e9)
        pin(two.info["pid"], second)
        values["two_procs"].append(clients.run(pair_in_two, seconds) / seconds / 1e9)
        pin(one.info["pid"], first | second)
        values["one_proc_two_cores"].append(clients.run(pair_in_one, seconds) / seconds / 1e9)
    pin(one.info["pid"], set(cpus))
    pin(two.info["pid"], set(cpus))
    median = {name: statistics.median(v) for name, v in values.items()}
    return {
        "two_procs_vs_one": median["two_procs"] / median["one_core"],
        "one_proc_two_cores_vs_one": median["one_proc_two_cores"] / median["one_core"],
        "pinned_get_gbps": median,
    }
