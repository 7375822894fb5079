"""scripts/bench_serving.py: its metric functions, and one run against a real server on a tiny model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixture import Server

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bench  # dataclasses look their module up while the class is built
_spec.loader.exec_module(bench)


# ---- metric functions ----
def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 100) == 4.0
    assert bench.percentile(values, 50) == pytest.approx(2.5)
    assert bench.percentile(values, 90) == pytest.approx(3.7)
    assert bench.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        bench.percentile([], 50)
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\]"):
        bench.percentile(values, 101)


def test_latency_stats_are_milliseconds_and_none_when_empty() -> None:
    stats = bench.latency_stats([0.1 * i for i in range(1, 11)])  # 100 .. 1000 ms
    assert stats.mean == pytest.approx(550.0)
    assert stats.p50 == pytest.approx(550.0)
    assert stats.p90 == pytest.approx(910.0)
    assert stats.p99 == pytest.approx(991.0)
    assert bench.latency_stats([]) is None


def test_itl_splits_a_coalesced_chunk_over_its_tokens() -> None:
    # first chunk (1 token) at 0.10 s is the TTFT; then 1 token after 0.05 s, then 3 tokens after 0.15 s
    itls = bench.inter_token_latencies([0.10, 0.15, 0.30], [1, 1, 3])
    assert itls == pytest.approx([0.05, 0.05, 0.05, 0.05])
    assert bench.inter_token_latencies([0.2], [4]) == []  # one chunk: no gaps
    assert bench.inter_token_latencies([], []) == []
    with pytest.raises(ValueError, match="2 chunk times but 1 token counts"):
        bench.inter_token_latencies([0.1, 0.2], [1])


def test_compute_metrics_counts_only_successes_in_throughput() -> None:
    ok1 = bench.RequestResult(prompt_len=16, output_len=4, success=True, latency=0.4,
                              chunk_times=[0.1, 0.2, 0.4], chunk_tokens=[1, 1, 2])
    ok2 = bench.RequestResult(prompt_len=8, output_len=2, success=True, latency=0.3,
                              chunk_times=[0.2, 0.3], chunk_tokens=[1, 1])
    failed = bench.RequestResult(prompt_len=100, output_len=1, error="HTTP 400: too long")
    m = bench.compute_metrics([ok1, failed, ok2], duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (24, 6)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(12.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.ttft_ms.mean == pytest.approx(150.0) and m.ttft_ms.p50 == pytest.approx(150.0)
    assert m.itl_ms.mean == pytest.approx(100.0)  # gaps per token: 100, 100, 100 (ok1) and 100 (ok2)
    assert m.e2e_ms.p50 == pytest.approx(350.0)
    assert m.errors == ["HTTP 400: too long"]
    report = bench.format_report(m)
    assert re.search(r"^Successful requests:\s+2$", report, re.MULTILINE), report
    assert re.search(r"^Output token throughput \(tok/s\):\s+3\.00$", report, re.MULTILINE), report
    assert "HTTP 400: too long" in report
    with pytest.raises(ValueError, match="duration_s must be positive"):
        bench.compute_metrics([ok1], duration_s=0.0)


def test_non_streamed_results_report_no_ttft_or_itl() -> None:
    m = bench.compute_metrics([bench.RequestResult(prompt_len=4, output_len=3, success=True, latency=0.5)], 1.0)
    assert m.ttft_ms is None and m.itl_ms is None and m.e2e_ms.mean == pytest.approx(500.0)
    assert re.search(r"^TTFT\s+n/a\s+n/a\s+n/a\s+n/a$", bench.format_report(m), re.MULTILINE)


def test_workload_is_seeded_and_in_range() -> None:
    assert bench.random_lengths(5, 16, 1.0, random.Random(0)) == [16] * 5
    lengths = bench.random_lengths(200, 16, 0.5, random.Random(0))
    assert min(lengths) >= 8 and max(lengths) <= 16 and len(set(lengths)) > 1
    prompts = bench.random_prompts([50, 50], 320, random.Random(1))
    assert prompts == bench.random_prompts([50, 50], 320, random.Random(1))
    assert all(10 <= t < 320 for p in prompts for t in p)
    assert bench.arrival_offsets(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    offsets = bench.arrival_offsets(2000, 10.0, random.Random(0))
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def sse_result(body: str, status: int = 200, stream: bool = True) -> Any:
    """Run run_one against a canned /generate answer."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body.encode(), headers={"content-type": "text/event-stream"})

    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await bench.run_one(client, "http://x/generate", [11, 12], 2, stream, 5.0, None)

    return asyncio.run(go())


def chunk(ids: list[int], finish: str | None = None) -> str:
    meta = {"finish_reason": {"type": finish} if finish else None}
    return f"data: {json.dumps({'text': '', 'output_ids': ids, 'meta_info': meta})}\n\n"


def test_stream_parsing_records_chunks_and_failures() -> None:
    ok = sse_result(chunk([5]) + chunk([5, 6], "length") + "data: [DONE]\n\n")
    assert ok.success and ok.output_len == 2 and ok.chunk_tokens == [1, 1] and ok.latency >= ok.chunk_times[-1]
    mid_error = sse_result(chunk([5]) + 'data: {"error": {"message": "rank died", "code": 503}}\n\ndata: [DONE]\n\n')
    assert not mid_error.success and mid_error.error == "stream error: rank died"
    truncated = sse_result(chunk([5]))
    assert not truncated.success and "without data: [DONE]" in truncated.error
    aborted = sse_result(chunk([5], "abort") + "data: [DONE]\n\n")
    assert not aborted.success and "finish_reason {'type': 'abort'}" in aborted.error
    rejected = sse_result('{"error": {"message": "prompt too long"}}', status=400)
    assert not rejected.success and rejected.error.startswith("HTTP 400:") and "prompt too long" in rejected.error


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--request-rate", "0"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--request-rate must be > 0" in proc.stderr


# ---- end to end ----
@pytest.mark.timeout(120)
def test_bench_serving_against_a_real_server(tiny_model_dirs: dict[str, Path], smollm2_dir: Path,
                                             tmp_path: Path) -> None:
    with Server("--model-path", str(tiny_model_dirs["llama"]), "--tokenizer-path", str(smollm2_dir),
                "--max-total-tokens", "4096", startup_timeout=60) as server:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--base-url", server.url, "--num-prompts", "8",
             "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency", "4",
             "--request-timeout", "60", "--json", "out.json"],
            capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "vocab 320" in out, out  # read from /server_info: ids stay inside the tiny vocabulary
    assert re.search(r"^Successful requests:\s+8$", out, re.MULTILINE), out
    assert re.search(r"^Failed requests:\s+0$", out, re.MULTILINE), out
    assert re.search(r"^Total generated tokens:\s+64$", out, re.MULTILINE), out
    for name in ("TTFT", "ITL", "E2E latency"):
        assert re.search(rf"^{name}(\s+\d+\.\d\d){{4}}$", out, re.MULTILINE), out
    report = json.loads((tmp_path / "out.json").read_text())
    assert (report["completed"], report["failed"], report["errors"]) == (8, 0, [])
    assert report["total_input_tokens"] == 8 * 16 and report["output_lens"] == [8] * 8
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    assert 0 < report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"]
