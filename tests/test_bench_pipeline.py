"""scripts/bench_pipeline.py: its configurations and arguments, and one full round on a tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import bench_pipeline as bench
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_pipeline.py"


def test_configurations_put_the_baseline_first() -> None:
    assert bench.configs(2, True) == {
        "one batch in flight": ("--pp-micro-batches", "1"),
        "micro-batching": (),
        "no pipeline": ("--pp-size", "1"),
    }
    assert list(bench.configs(3, False)) == ["one batch in flight", "micro-batching"]
    args = bench.parse_args(["--pp", "3", "--tp", "2"])
    assert args.server_args == ["--pp-size", "3", "--tp-size", "2"]


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--pp", "1"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--pp must be >= 2" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
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
        timeout=290,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for config in ("micro-batching", "no pipeline"):
        assert re.search(
            rf"^throughput of {config}: \d+\.\d\dx of one batch in flight$", proc.stdout, re.MULTILINE
        ), out
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [r["config"] for r in results] == ["one batch in flight", "micro-batching", "no pipeline"]
    for row in results:
        assert row["output_throughput"] > 0, row
        assert [(r["completed"], r["failed"]) for r in row["runs"]] == [(4, 0)], row
