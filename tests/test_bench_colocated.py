"""scripts/bench_colocated.py: one short run of srt alone, without load and under a one-thread hog."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_colocated.py"


@pytest.mark.slow  # two servers and three load levels, ~20 s: the script, not a README promise
def test_one_round_per_level_prints_speeds_and_slowdowns(tmp_path: Path) -> None:
    out = tmp_path / "colocated.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-llama", "--hogs", "0", "1", "--rounds", "1", "--output-len", "16"]
        + ["--prompt-words", "40"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = re.findall(r"^srt\s+(\d)\s+([\d.]+)\s+([\d.]+)x\s+(\d+)\s+([\d.]+)x", run.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"] and rows[0][2] == rows[0][4] == "1.00", run.stdout
    assert all(float(r[1]) > 0 and int(r[3]) > 0 for r in rows)
    report = json.loads(out.read_text())
    assert report["output_len"] == 16 and set(report["tok_s"]["srt"]) == set(report["ttft_s"]["srt"]) == {
        "0",
        "1",
    }
    assert not subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True).stdout  # hogs gone
