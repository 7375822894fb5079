"""scripts/bench_constrained.py: its table and its argument checks (the run itself is measured by hand,
docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bench_constrained as bench

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_constrained.py"


def test_table_takes_medians_and_ratios_to_unconstrained() -> None:
    results = {
        (b, m): [100.0 * b, 90.0 * b, 300.0 * b] if m == "unconstrained" else [45.0 * b] * 3
        for b in bench.BATCHES
        for m in bench.MODES
    }
    lines = bench.format_table(results).splitlines()
    assert lines[2].split() == ["1", "unconstrained", "100.0", "1.00x"]
    assert lines[3].split() == ["1", "regex", "45.0", "0.45x"]
    assert lines[-1].split() == ["32", "json_schema", "1440.0", "0.45x"]


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--output-len", "1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--output-len must be >= 2" in proc.stderr
