"""The tier benchmark's network part: on a real Mooncake Store (started and stopped by the bench) it reports every
network figure, finite; without the store installed it still runs, with null figures and a note saying why."""

import math

from bench import _network_tier
from bench._network_tier import FIGURES, TINY, measure_network
from bench.tiers import SPEC
from devtools.store_services import mooncake_importable
from tests.network_store import require_mooncake


def test_a_tiny_run_reports_every_network_figure_finite(tmp_path):
    require_mooncake()
    results = measure_network(SPEC, str(tmp_path), TINY)
    for name in FIGURES:
        assert isinstance(results[name], float) and math.isfinite(results[name]) and results[name] > 0, name
    assert results["network_bench_bytes"] == TINY.rounds * TINY.blocks * SPEC.block_bytes
    assert "Mooncake Store" in results["network_note"]


def test_without_the_store_the_figures_are_null_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(_network_tier, "mooncake_importable", lambda: False)
    results = measure_network(SPEC, str(tmp_path), TINY)
    assert all(results[name] is None for name in FIGURES)
    assert "not importable" in results["network_note"]
    assert list(tmp_path.iterdir()) == []  # no store was started


def test_the_probe_the_bench_relies_on_matches_the_import():
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        assert not mooncake_importable()
    else:
        assert mooncake_importable()
