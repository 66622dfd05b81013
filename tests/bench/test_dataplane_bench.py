"""Smoke tests of bench/dataplane.py's pure helpers (the benchmark itself needs two processes and runs by hand)."""

from bench import dataplane as bd


def test_gbps_and_ratio():
    assert bd.gbps(2_000_000_000, 2.0) == 1.0
    assert bd.gbps(1, 0.0) == float("inf")
    assert bd.ratio(1.5, 3.0) == 0.5
    assert bd.ratio(1.0, 0.0) != bd.ratio(1.0, 0.0)  # nan


def test_percentile_nearest_rank():
    values = list(range(1, 101))
    assert bd.percentile(values, 50) == 50
    assert bd.percentile(values, 99) == 99
    assert bd.percentile(values, 100) == 100
    assert bd.percentile([7.0], 99) == 7.0


def test_token_ranges_are_distinct():
    a, b = bd.token_range(0, 256), bd.token_range(1, 256)
    assert len(a) == 256 and not set(a) & set(b)


def test_median_rounds_interleaves_and_skips_warmup():
    calls = []

    def make(name, values):
        it = iter(values)

        def fn():
            calls.append(name)
            return next(it)

        return fn

    out = bd.median_rounds({"a": make("a", [100, 1, 2, 3]), "b": make("b", [100, 5, 4, 6])}, rounds=3, warmup_rounds=1)
    assert out == {"a": 2, "b": 5}
    assert calls == ["a", "b"] * 4


def test_spec_is_two_mib_blocks():
    spec = bd.llama3_8b_like_spec()
    assert spec.block_bytes == 2 << 20 and spec.kv_bytes_per_token == 128 << 10


def test_size_labels_and_the_like_for_like_ratios():
    from bench._dataplane_sweeps import size_label

    assert [size_label(n) for n in (64 << 10, 1 << 20, 64 << 20)] == ["64KiB", "1MiB", "64MiB"]
    r = {
        "put_gbps": 1.0,
        "raw_tls_gbps": 2.0,
        "uds_put_gbps": 3.0,
        "raw_uds_gbps": 4.0,
        "get_gbps": 1.0,
        "raw_tls_pull_reused_gbps": 2.0,
        "uds_get_gbps": 3.0,
        "raw_uds_pull_reused_gbps": 6.0,
        "uds_get_fresh_gbps": 1.0,
        "redis_get_gbps": 4.0,
        "redis_set_gbps": 1.5,
    }
    bd._ratios(r)
    # every get ratio divides by a pull into a reused buffer (never a push, never fresh memory)
    assert r["get_vs_raw_tls"] == r["get_vs_raw_pull"] == r["get_vs_raw_tls_pull"] == 0.5
    assert r["uds_get_vs_raw"] == r["uds_get_vs_raw_pull"] == 0.5
    assert r["uds_get_vs_redis"] == 0.25 and r["uds_get_out_vs_redis"] == 0.75 and r["uds_put_vs_redis"] == 2.0


def test_the_report_renders_every_figure_the_json_carries():
    from bench._dataplane_report import table

    sizes = {"64KiB": {"get": 300.0, "get_out": 250.0, "redis_get": 60.0, "put": 700.0, "redis_set": 60.0}}
    r = {
        "mode": "quick",
        "op_bytes": 32 << 20,
        "op_tokens": 256,
        "ops_per_round": 3,
        "rounds": 5,
        "ssl": "x",
        "tls_version": "TLSv1.3",
        "ktls": "not on this kernel",
        "lookup_p50_us": 300.0,
        "lookup_p99_us": 500.0,
        "lookup_tokens": 4096,
        "lookup_samples": 300,
        "lookup_half_hit_vs_full_hit": 0.5,
        "wire_lookup_half_hit_vs_full_hit": 0.7,
        "put_gbps_by_tokens": {"256": 1.0, "8192": 2.0},
        "get_gbps_by_tokens": {"256": 3.0, "8192": 4.0},
        "long_put_vs_short_put": 1.2,
        "by_size_us": sizes,
        "get_vs_redis_by_size": {"64KiB": 0.2},
        "put_vs_redis_by_size": {"64KiB": 0.09},
        "small_get_vs_redis": 0.2,
        "get_gbps_by_clients": {"1": 3.0},
        "server_cpu_s_per_gb_by_clients": {"1": 0.3},
        "pinned_get_gbps": {"one_core": 3.0, "two_procs": 5.0, "one_proc_two_cores": 4.0},
        "two_procs_vs_one": 1.6,
        "one_proc_two_cores_vs_one": 1.3,
        "loadavg_1min_at_start": 0.1,
        "loadavg_1min_at_end": 1.0,
        "cpu_count": 2,
    }
    text = table(r)
    assert "0.20 x (goal >= 0.5)" in text and "two_procs_vs_one 1.60 x" in text and "8,192" in text
