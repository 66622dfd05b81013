"""bench/migration.py --quick runs end to end (real mutual TLS over loopback) and reports its JSON last line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_migration_bench_quick_reports_throughput():
    done = subprocess.run(
        [sys.executable, "-m", "bench.migration", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "migration" and result["mode"] == "quick"
    assert result["migration_gbps"] > 0 and result["raw_tls_gbps"] > 0
    assert abs(result["migration_vs_raw_tls"] - result["migration_gbps"] / result["raw_tls_gbps"]) < 0.01
    assert result["bytes_per_round"] == result["num_blocks"] * result["block_bytes"]
