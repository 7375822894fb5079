"""scripts/bench_guards.py: its summary functions, and one full round on a tiny model at TP=2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import bench_guards as guards
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_guards.py"


def test_rounds_alternate_order() -> None:
    assert guards.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_summary_takes_medians_and_ratios_to_baseline() -> None:
    def run(config: str, r: int, tput: float, itl: float | None) -> object:
        return guards.Run(config, r, tput, itl, completed=4, failed=0)

    runs = [
        run("baseline", 0, 100.0, 10.0),
        run("baseline", 1, 120.0, 8.0),
        run("baseline", 2, 90.0, 12.0),
        run("token sync", 0, 99.0, None),
        run("token sync", 1, 99.0, 11.0),
        run("token sync", 2, 10.0, 50.0),
    ]
    rows = guards.summarize(runs, {name: guards.CONFIGS[name] for name in ("baseline", "token sync")})
    assert [r["output_throughput"] for r in rows] == [
        100.0,
        99.0,
    ]  # the slow outlier does not move the median
    assert [r["mean_itl_ms"] for r in rows] == [10.0, pytest.approx(30.5)]
    assert [r["ratio"] for r in rows] == [1.0, pytest.approx(0.99)]
    table = guards.format_table(rows, guards.RATIO_LINE)
    assert "throughput cost of token sync: 0.99x of baseline" in table.splitlines()
    with pytest.raises(ValueError, match="no runs of 'both'"):
        guards.summarize(runs, {"baseline": (), "both": ()})


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--rounds must be >= 1" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_round_on_a_tiny_model(
    tiny_model_dirs: dict[str, Path], smollm2_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(tiny_model_dirs["llama"]),
            "--tokenizer-path",
            str(smollm2_dir),
            "--tp",
            "2",
            "--rounds",
            "1",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "8",
            "--max-concurrency",
            "4",
            "--dtype",
            "float32",
            "--max-total-tokens",
            "4096",
            "--request-timeout",
            "60",
            "--startup-timeout",
            "120",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for config in ("token sync", "consensus checker", "both"):
        assert re.search(
            rf"^throughput cost of {config}: \d+\.\d\dx of baseline$", proc.stdout, re.MULTILINE
        ), out
    assert "vocab 320" in proc.stdout, out  # prompt ids stayed inside the tiny vocabulary
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [r["config"] for r in results] == ["baseline", "token sync", "consensus checker", "both"]
    for row in results:
        assert row["output_throughput"] > 0 and row["mean_itl_ms"] > 0, row
        assert [(r["completed"], r["failed"]) for r in row["runs"]] == [(4, 0)], row
