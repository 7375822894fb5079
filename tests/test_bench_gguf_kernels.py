"""scripts/bench_gguf_kernels.py on a small layer: one row of the table per rows and round, every kind
timed (the figures themselves are measured by hand, docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_executor.cpu.kernels import build

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gguf_kernels.py"


@pytest.mark.skipif(
    not (build.bf16_linear_available() and build.q5k_available() and build.q8_available()),
    reason="the block kernels need AVX-512 BF16 and VNNI, or AVX2, FMA and F16C",
)
def test_small_run_prints_every_kind_per_rows_and_round() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--n",
            "32",
            "--k",
            "256",
            "--rows",
            "1",
            "3",
            "--copies",
            "2",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "bf16 |           Q4_K |           Q5_K |           Q8_0 |           Q6_K" in out
    rows = re.findall(r"^\s+(\d+) \|\s+(\d+) \|(.*)$", out, re.M)
    assert [(int(r), int(n)) for r, n, _ in rows] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    for _, _, cells in rows:
        assert len(re.findall(r"\d+\.\d \((\d+\.\d\d)x\)", cells)) == 5 and "(1.00x)" in cells.split("|")[0]
