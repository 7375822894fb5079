"""scripts/bench_data_parallel.py: one full round through sglang-router (one replica, then --dp-size
2) on a tiny model with SmolLM2's vocabulary, prints the side-by-side table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_data_parallel.py"

pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")


@pytest.mark.slow  # two server trees and two routers start
def test_one_round_prints_both_configs(tmp_path: Path, smollm2_dir: Path) -> None:
    model = make_tiny_model("llama_smollm2_vocab", tmp_path / "llama")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(model),
            "--tokenizer-path",
            str(smollm2_dir),
            "--dtype",
            "float32",
            "--num-prompts",
            "6",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--max-concurrency",
            "3",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "throughput of 2 replicas:" in proc.stdout
        and "of 1 replica, both through sglang-router" in proc.stdout
    )
    rows = json.loads(out.read_text())["results"]
    assert [r["config"] for r in rows] == ["1 replica", "2 replicas"]
    assert all(run["completed"] == 6 and run["failed"] == 0 for r in rows for run in r["runs"])


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--rounds must be >= 1" in proc.stderr
