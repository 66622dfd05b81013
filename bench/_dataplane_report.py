"""bench.dataplane's human tables (the JSON line after them is what scripts read)."""

from __future__ import annotations

MIB = 1 << 20


def _gb(r: dict, key: str) -> str:
    return f"{r[key]:.2f} GB/s" if r.get(key) is not None else "n/a"


def _x(r: dict, key: str, goal: str = "") -> str:
    if r.get(key) is None:
        return "n/a"
    return f"{r[key]:.2f} x" + (f" (goal {goal})" if goal else "")


def _rows(rows: list[tuple[str, str, str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return [f"  {a:<{widths[0]}}  {b:>{widths[1]}}  {c}" for a, b, c in rows]


def headline(r: dict) -> list[str]:
    rows = [
        ("SDK put, TLS 1.3", _gb(r, "put_gbps"), f"{_x(r, 'put_vs_raw_tls', '>= 0.7')} raw TLS push"),
        ("SDK get, TLS 1.3", _gb(r, "get_gbps"), f"{_x(r, 'get_vs_raw_pull', '>= 0.8')} raw TLS pull, reused buffer"),
        ("raw TLS 1.3 push", _gb(r, "raw_tls_gbps"), "client -> node process, into a reused buffer, 1-byte ack"),
        ("raw TLS 1.3 pull", _gb(r, "raw_tls_pull_reused_gbps"), "node process -> client, into a reused buffer"),
        ("SDK put, UDS", _gb(r, "uds_put_gbps"), f"{_x(r, 'uds_put_vs_raw')} raw UDS push"),
        (
            "SDK get, UDS",
            _gb(r, "uds_get_gbps"),
            f"{_x(r, 'uds_get_vs_raw_pull', '>= 0.8')} raw UDS pull, reused buffer",
        ),
        ("raw UDS push", _gb(r, "raw_uds_gbps"), "client -> node process, into a reused buffer, 1-byte ack"),
        ("raw UDS pull", _gb(r, "raw_uds_pull_reused_gbps"), "node process -> client, into a reused buffer"),
        (
            "raw pulls, fresh buffer",
            f"{_gb(r, 'raw_tls_pull_gbps')} / {_gb(r, 'raw_uds_pull_gbps')}",
            "diagnostic (TLS / UDS): first touch of fresh pages per answer",
        ),
        (
            "SDK get UDS, fresh result",
            _gb(r, "uds_get_fresh_gbps"),
            "a new tensor per get, as Redis returns a new object",
        ),
        (
            "Redis SET (pipelined)",
            _gb(r, "redis_set_gbps"),
            f"16 x 2 MiB per pipeline; SDK UDS put = {_x(r, 'uds_put_vs_redis')}",
        ),
        (
            "Redis GET (pipelined)",
            _gb(r, "redis_get_gbps"),
            f"SDK UDS get, fresh = {_x(r, 'uds_get_vs_redis')}; into out = {_x(r, 'uds_get_out_vs_redis')}",
        ),
        (
            "lookup p50 / p99 (TLS)",
            f"{r['lookup_p50_us']:.0f} / {r['lookup_p99_us']:.0f} us",
            f"{r['lookup_tokens']}-token cached prompt, {r['lookup_samples']} samples",
        ),
        (
            "lookup, half / full hit",
            f"{r['lookup_half_hit_vs_full_hit']:.2f} x",
            f"in the engine (goal <= 0.6); over UDS with the round trip: {r['wire_lookup_half_hit_vs_full_hit']:.2f} x",
        ),
    ]
    return _rows(rows)


def by_tokens(r: dict) -> list[str]:
    lines = [
        "  by request length (UDS, 4 layers = 16 KiB/token, 32 MiB frames: a frame per 2,047 tokens)",
        "    tokens    put GB/s   get GB/s",
    ]
    for n, put in r["put_gbps_by_tokens"].items():
        lines.append(f"    {int(n):>7,}  {put:>9.2f}  {r['get_gbps_by_tokens'][n]:>9.2f}")
    lines.append(f"    long_put_vs_short_put (8,192 vs 1,024 tokens): {_x(r, 'long_put_vs_short_put', '>= 0.9')}")
    return lines


def by_size(r: dict) -> list[str]:
    if "by_size_us" not in r:
        return [f"  by operation size: skipped ({r.get('redis_error', 'no Redis')})"]
    lines = [
        "  by operation size (UDS, 1 layer = 4 KiB/token) against a private Redis with hiredis, us per operation",
        "    size     get   get(out)  Redis GET  get/Redis     put  Redis SET  put/Redis",
    ]
    for label, row in r["by_size_us"].items():
        lines.append(
            f"    {label:>6} {row['get']:>7.0f} {row['get_out']:>9.0f} {row['redis_get']:>10.0f} "
            f"{r['get_vs_redis_by_size'][label]:>9.2f}x {row['put']:>7.0f} {row['redis_set']:>10.0f} "
            f"{r['put_vs_redis_by_size'][label]:>9.2f}x"
        )
    lines.append(f"    small_get_vs_redis (64 KiB, both results fresh): {_x(r, 'small_get_vs_redis', '>= 0.5')}")
    return lines


def by_clients(r: dict) -> list[str]:
    lines = [
        "  concurrent clients (UDS gets of 32 MiB into reused buffers; one node process)",
        "    clients  aggregate GB/s  node CPU s per GB",
    ]
    for n, rate in r["get_gbps_by_clients"].items():
        lines.append(f"    {int(n):>7}  {rate:>14.2f}  {r['server_cpu_s_per_gb_by_clients'][n]:>17.3f}")
    pinned = r.get("pinned_get_gbps") or {}
    if pinned:
        lines.append(
            f"    two clients, two caches: one node process on one core {pinned['one_core']:.2f} GB/s, "
            f"two node processes on a core each {pinned['two_procs']:.2f} GB/s "
            f"(two_procs_vs_one {_x(r, 'two_procs_vs_one')}), one process on both cores "
            f"{pinned['one_proc_two_cores']:.2f} GB/s ({_x(r, 'one_proc_two_cores_vs_one')})"
        )
    return lines


def table(r: dict) -> str:
    lines = [
        f"bench.dataplane ({r['mode']}): {r['op_bytes'] // MIB} MiB per op "
        f"({r['op_tokens']} tokens of a Llama-3-8B-like "
        f"layout), {r['ops_per_round']} ops per contender per round, median of {r['rounds']} rounds; "
        f"{r.get('tls_version', '?')}, {r['ssl']}; kTLS: {r['ktls']}",
    ]
    lines += headline(r) + by_tokens(r) + by_size(r) + by_clients(r)
    lines.append(
        f"  (load average {r['loadavg_1min_at_start']:.1f} -> {r['loadavg_1min_at_end']:.1f} on "
        f"{r['cpu_count']} cores: a shared, noisy machine; read the ratios, measured side by side in this run)"
    )
    return "\n".join(lines)
