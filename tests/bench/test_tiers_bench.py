"""The tier benchmark runs end to end (quick) and reports every figure it promises, measured on real files."""

import json
import subprocess
import sys

from bench._network_tier import FIGURES as NETWORK_FIGURES
from bench.tiers import drop_page_cache, run

REQUIRED = (
    "ssd_write_gbps",
    "ssd_read_gbps",
    "disk_baseline_write_gbps",
    "disk_baseline_read_gbps",
    "warm_restart_s_per_gib",
    "dram_hit_p50_us",
    "ssd_hit_p50_us",
)


def test_quick_run_reports_every_figure_and_cleans_up(tmp_path):
    results = run(True, str(tmp_path))
    for key in REQUIRED:
        assert results[key] > 0, key
    assert "page cache" in results["page_cache_note"]
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_the_cli_prints_the_json_last(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.tiers", "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(REQUIRED) <= set(last)
    assert set(NETWORK_FIGURES) | {"network_note"} <= set(last)  # null when the store is not installed


def test_drop_page_cache_leaves_file_contents_intact(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 8192)
    drop_page_cache(str(tmp_path))
    assert (tmp_path / "f").read_bytes() == b"x" * 8192
