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

    out = bd.median_rounds({"a": make("a", [100, 1, 2, 3]), "b": make("b", [100, 5, 4, 6])}, rounds=3,
                           warmup_rounds=1)  # fmt: skip
    assert out == {"a": 2, "b": 5}
    assert calls == ["a", "b"] * 4


def test_spec_is_two_mib_blocks():
    spec = bd.llama3_8b_like_spec()
    assert spec.block_bytes == 2 << 20 and spec.kv_bytes_per_token == 128 << 10
