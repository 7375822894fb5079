"""scripts/bench_one_batch.py runs end to end and reports srt and transformers side by side."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_executor.cpu.kernels import build

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_one_batch.py"


@pytest.mark.slow  # ~11 s: the script's report, no README promise
def test_bench_one_batch_reports_tables_ratios_and_json(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    out_json = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(tiny_model_dirs["llama"]),
            "--batch-size",
            "1",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--compare-transformers",
            "--compare-deterministic",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (
        "srt (tp=1)" in out
        and "transformers generate" in out
        and "srt --enable-deterministic-inference" in out
    )
    assert len(re.findall(r"batch size \| prefill tok/s \| decode tok/s \| +decode ms/step", out)) == 3, out
    for bs in (1, 2):
        assert re.search(rf"^\s+{bs} \|\s+[\d.]+ \|\s+[\d.]+ \|\s+[\d.]+$", out, re.MULTILINE), out
        for phase in ("prefill", "decode"):
            assert re.search(
                rf"^ratio vs transformers \(batch {bs} {phase}\): \d+\.\d\dx$", out, re.MULTILINE
            ), out
        assert re.search(
            rf"^deterministic / default \(batch {bs}\): prefill \d+\.\d\dx, decode \d+\.\d\dx$",
            out,
            re.MULTILINE,
        ), out

    floor = re.search(
        r"^weight-bandwidth floor \(batch 1 decode\): ([\d.]+) ms/step = \d+ steps/s \((\d+) MB of "
        r"weights at ([\d.]+) GB/s, the read bandwidth measured between srt's runs\); srt batch-1 decode at "
        r"\d+% of it$",
        out,
        re.MULTILINE,
    )
    assert floor is not None, out
    assert re.search(
        r"^prefill compute bound: \d+ tok/s \(\d+ MFLOP/token at \d+ GFLOP/s measured bf16 matmul\); "
        r"srt prefill at \d+% of it$",
        out,
        re.MULTILINE,
    ), out

    report = json.loads(out_json.read_text())
    assert (report["input_len"], report["output_len"], report["dtype"]) == (8, 4, "bfloat16")
    assert report["read_bandwidth_bytes_per_s"] > 1e8 and report["weight_bytes"] > 0
    assert report["matmul_flops"] > 1e9 and report["prefill_compute_bound_tok_s"] > 0
    for engine in ("srt", "transformers", "deterministic"):
        assert [r["batch_size"] for r in report[engine]] == [1, 2]
        for row in report[engine]:
            for key in ("prefill_tok_s", "decode_tok_s", "decode_ms_per_step"):
                assert row[key] > 0, (engine, key, row)
    assert all(r["prefill"] > 0 and r["decode"] > 0 for r in report["ratios"])


def test_bench_one_batch_rejects_bad_lengths() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--output-len", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "--output-len must be >= 1, got 0" in proc.stderr


def test_bench_one_batch_against_llama_cpp(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """With llama-cpp-python installed: its batch-1 row and ratios on the bundled GGUF; without it,
    a message naming the package to install."""
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(tiny_model_dirs["llama"]),
            "--batch-size",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--compare-llama-cpp",
            "--json",
            "out.json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    if importlib.util.find_spec("llama_cpp") is None:
        assert proc.returncode != 0 and "pip install llama-cpp-python" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert "llama.cpp (batch 1)" in proc.stdout, proc.stdout
    for phase in ("prefill", "decode"):
        assert re.search(rf"^ratio vs llama.cpp \(batch 1 {phase}\): \d+\.\d\dx$", proc.stdout, re.MULTILINE)
    row = json.loads((tmp_path / "out.json").read_text())["llama_cpp"][0]
    assert row["batch_size"] == 1 and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0


def test_bandwidth_probe_runs_between_the_timed_runs() -> None:
    """The floor's read-bandwidth probe is one of `measure`'s timers, so it runs in the same
    minutes as the batch-1 step it is compared with (the best of its runs), not once at the end."""
    import bench_one_batch as bench

    calls: list[str] = []

    def timer(name: str, seconds: float):
        def once() -> tuple[float, float]:
            calls.append(name)
            return seconds, seconds

        return once

    probe = bench.bandwidth_timer(num_bytes=1 << 20)
    assert all(s > 0 for s in probe())
    spec = bench.BenchSpec((1,), 8, 4, warmup=1, runs=3, seed=0)
    results = bench.measure([timer("srt", 0.5), timer("probe", 0.25)], spec, 1)
    assert calls == ["srt", "probe"] + ["srt", "probe"] * 3
    assert results[1].prefill_s == 0.25


def test_int8_prefill_is_held_to_the_int8_matmul_rate(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """With --quantization w8a8_int8 the linears multiply in int8, so the compute bound the prefill is
    held to comes from torch's int8 matmul, not the bf16 one (which int8 can exceed)."""
    if not build.int8_available():
        pytest.skip("neither AMX int8 tiles nor AVX-512 VNNI here: --quantization w8a8_int8 is refused")
    out_json = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            str(tiny_model_dirs["llama"]),
            "--batch-size",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--runs",
            "1",
            "--warmup",
            "1",
            "--quantization",
            "w8a8_int8",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    bound = re.search(
        r"^prefill compute bound: (\d+) tok/s \(\d+ MFLOP/token at (\d+) GOP/s measured int8 matmul\); "
        r"srt prefill at \d+% of it$",
        proc.stdout,
        re.MULTILINE,
    )
    assert bound is not None, proc.stdout
    report = json.loads(out_json.read_text())
    assert report["quantization"] == "w8a8_int8" and report["int8_matmul_ops"] > 1e9
    assert abs(report["prefill_compute_bound_tok_s"] - int(bound.group(1))) <= 1
