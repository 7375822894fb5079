"""scripts/bench_control_plane.py: the per-rank step timing from /metrics scrapes, and one full run on
a tiny model at TP=2 (step timing of every rank, idle CPU, memory, the KV budget), tables and JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import bench_control_plane as bench
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_control_plane.py"

NUMBER = r"(\d+\.\d+)"


def test_rank_timings_are_the_counters_gains_per_rank() -> None:
    def samples(
        steps: float, broadcast: float, schedule: float, forward: float
    ) -> dict[tuple[str, Any], float]:
        out: dict[tuple[str, Any], float] = {}
        for rank in (0, 1, 2, 3):  # TP 2 x PP 2
            labels = (("rank", str(rank)),)
            out[("srt:forward_steps_total", labels)] = steps + rank
            out[("srt:step_broadcast_seconds_total", labels)] = broadcast * (rank + 1)
            out[("srt:step_schedule_seconds_total", labels)] = schedule
            out[("srt:step_forward_seconds_total", labels)] = forward
        return out

    rows = bench.rank_timings(
        samples(10, 0.1, 0.2, 1.0), samples(30, 0.2, 0.3, 2.8), steps=18, tp_size=2, pp_size=2
    )
    assert [r.name for r in rows] == [
        "scheduler_PP0_TP0",
        "scheduler_PP0_TP1",
        "scheduler_PP1_TP0",
        "scheduler_PP1_TP1",
    ]
    first = rows[0]
    assert (first.steps, first.forward_steps) == (18, 20)
    assert first.ms_per_step(first.forward_s) == pytest.approx(100.0)
    assert first.control_plane_pct == pytest.approx(100 * 0.2 / 2.0)  # 0.1 broadcast + 0.1 scheduling
    assert rows[3].broadcast_s == pytest.approx(0.4)
    table = bench.format_timing_table(rows, "t")
    assert table.splitlines()[-1].endswith(
        "(target <= 5%): FAIL"
    )  # rank 3 spends 0.5 of 2.3 s outside forward
    with pytest.raises(RuntimeError, match="enable-metrics"):
        bench.rank_timings({}, {}, steps=1, tp_size=1, pp_size=1)


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--mem-fraction-static", "0.8", "1.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--mem-fraction-static values must be in (0, 1)" in proc.stderr


@pytest.mark.slow  # the script's parts are tested above; the whole run costs ~20 s
@pytest.mark.timeout(150)
def test_full_run_on_a_tiny_model_at_tp2(
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
            "--tp-size",
            "2",
            "--dtype",
            "float32",
            "--max-total-tokens",
            "4096",
            "--num-prompts",
            "4",
            "--concurrency",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--idle-seconds",
            "1",
            "--request-timeout",
            "60",
            "--startup-timeout",
            "120",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for rank in (0, 1):
        row = re.search(
            rf"^\s+{rank}  scheduler_TP{rank}\s+(\d+)" + rf"\s+{NUMBER}" * 4 + r"\s+(PASS|FAIL)$",
            out,
            re.MULTILINE,
        )
        assert row is not None, out
        assert int(row[1]) > 0 and all(float(row[i]) > 0 for i in (2, 3, 4)) and 0 < float(row[5]) < 100, row[
            0
        ]
    assert re.search(
        rf"^control plane \(broadcast \+ scheduling\): at most {NUMBER}% of a busy step "
        r"\(target <= 5%\): (PASS|FAIL)$",
        out,
        re.MULTILINE,
    ), out
    for name in ("main", "scheduler_TP0", "scheduler_TP1", "detokenizer"):
        assert re.search(rf"^{name}\s+\d+\s+{NUMBER}\s+{NUMBER}$", out, re.MULTILINE), (name, out)  # idle CPU
        rss = re.search(
            rf"^{name}\s+\d+\s+{NUMBER}\s+{NUMBER}$", out.split("resident memory")[1], re.MULTILINE
        )
        assert rss is not None and float(rss[1]) > 10, (name, out)  # resident MB
    assert re.search(
        rf"^idle server: {NUMBER}% of one core \(target < 5%\): (PASS|FAIL)$", out, re.MULTILINE
    ), out
    assert "KV cache: 4096 tokens x 256 B/token per rank x 2 rank(s)" in out, (
        out
    )  # 2 layers x 1 KV head x 16 x K,V x fp32
    assert "KV cache honours --mem-fraction-static 0.8: PASS" in out, out

    report = json.loads((tmp_path / "out.json").read_text())
    assert (report["completed"], report["failed"]) == (4, 0)
    timing = report["step_timing"]
    assert [t["rank"] for t in timing] == [0, 1]
    # Every rank runs the same steps; the first of the workload began idle (rank 0 waited on its
    # socket), so it is not timed.
    assert (
        timing[0]["forward_steps"]
        == timing[1]["forward_steps"]
        > timing[0]["steps"]
        == timing[1]["steps"]
        >= 7
    )
    assert all(t[k] > 0 for t in timing for k in ("broadcast_s", "schedule_s", "forward_s"))
    assert report["idle_window_s"] >= 1 and all(r["cpu_s"] >= 0 for r in report["idle_cpu"])
    assert report["kv"][0]["bytes_per_rank"] == 4096 * 256 and report["kv"][0]["honoured"]
