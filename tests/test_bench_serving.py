"""scripts/bench_serving.py and its helpers: metric functions, stream parsing of both backends, backend
detection, and concurrency sweeps against one real server on a tiny model (srt's /generate and its
OpenAI /v1/completions), with the table and a PNG plot checked."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from server_fixture import Server

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_serving.py"
sys.path.insert(0, str(SCRIPT.parent))  # scripts/ is not a package

import bench_clients  # noqa: E402
import bench_metrics as metrics  # noqa: E402
import bench_serving as bench  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- metric functions ----
def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 100) == 4.0
    assert metrics.percentile(values, 50) == pytest.approx(2.5)
    assert metrics.percentile(values, 90) == pytest.approx(3.7)
    assert metrics.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        metrics.percentile([], 50)
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\]"):
        metrics.percentile(values, 101)


def test_latency_stats_are_milliseconds_and_none_when_empty() -> None:
    stats = metrics.latency_stats([0.1 * i for i in range(1, 11)])  # 100 .. 1000 ms
    assert stats.mean == pytest.approx(550.0)
    assert stats.p50 == pytest.approx(550.0)
    assert stats.p90 == pytest.approx(910.0)
    assert stats.p99 == pytest.approx(991.0)
    assert metrics.latency_stats([]) is None


def test_itl_splits_a_coalesced_chunk_over_its_tokens() -> None:
    # first chunk (1 token) at 0.10 s is the TTFT; then 1 token after 0.05 s, then 3 tokens after 0.15 s
    itls = metrics.inter_token_latencies([0.10, 0.15, 0.30], [1, 1, 3])
    assert itls == pytest.approx([0.05, 0.05, 0.05, 0.05])
    assert metrics.inter_token_latencies([0.2], [4]) == []  # one chunk: no gaps
    assert metrics.inter_token_latencies([], []) == []
    with pytest.raises(ValueError, match="2 chunk times but 1 token counts"):
        metrics.inter_token_latencies([0.1, 0.2], [1])


def test_compute_metrics_counts_only_successes_in_throughput() -> None:
    ok1 = metrics.RequestResult(
        prompt_len=16,
        output_len=4,
        success=True,
        latency=0.4,
        chunk_times=[0.1, 0.2, 0.4],
        chunk_tokens=[1, 1, 2],
    )
    ok2 = metrics.RequestResult(
        prompt_len=8, output_len=2, success=True, latency=0.3, chunk_times=[0.2, 0.3], chunk_tokens=[1, 1]
    )
    failed = metrics.RequestResult(prompt_len=100, output_len=1, error="HTTP 400: too long")
    m = metrics.compute_metrics([ok1, failed, ok2], duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (24, 6)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(12.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.ttft_ms.mean == pytest.approx(150.0) and m.ttft_ms.p50 == pytest.approx(150.0)
    assert m.itl_ms.mean == pytest.approx(100.0)  # gaps per token: 100, 100, 100 (ok1) and 100 (ok2)
    assert m.e2e_ms.p50 == pytest.approx(350.0)
    assert m.errors == ["HTTP 400: too long"]
    report = metrics.format_report(m)
    assert re.search(r"^Successful requests:\s+2$", report, re.MULTILINE), report
    assert re.search(r"^Output token throughput \(tok/s\):\s+3\.00$", report, re.MULTILINE), report
    assert "HTTP 400: too long" in report
    with pytest.raises(ValueError, match="duration_s must be positive"):
        metrics.compute_metrics([ok1], duration_s=0.0)


def test_non_streamed_results_report_no_ttft_or_itl() -> None:
    m = metrics.compute_metrics(
        [metrics.RequestResult(prompt_len=4, output_len=3, success=True, latency=0.5)], 1.0
    )
    assert m.ttft_ms is None and m.itl_ms is None and m.e2e_ms.mean == pytest.approx(500.0)
    assert re.search(r"^TTFT\s+n/a\s+n/a\s+n/a\s+n/a$", metrics.format_report(m), re.MULTILINE)


def test_sweep_table_has_one_row_per_level() -> None:
    streamed = metrics.RequestResult(
        prompt_len=4, output_len=2, success=True, latency=0.3, chunk_times=[0.1, 0.3], chunk_tokens=[1, 1]
    )
    plain = metrics.RequestResult(prompt_len=4, output_len=2, success=True, latency=0.5)
    levels = [
        metrics.LevelResult(1, metrics.compute_metrics([streamed], 1.0), [streamed]),
        metrics.LevelResult(None, metrics.compute_metrics([plain], 0.5), [plain]),
    ]
    table = metrics.format_sweep_table(levels, "title")
    rows = table.splitlines()
    assert "title" in rows[0] and rows[1].split() == [
        "concurrency",
        "completed",
        "failed",
        "req/s",
        "out",
        "tok/s",
        "TTFT",
        "p50",
        "TTFT",
        "p99",
        "ITL",
        "p50",
        "ITL",
        "p99",
        "E2E",
        "p50",
        "E2E",
        "p99",
    ]
    assert rows[3].split() == [
        "1",
        "1",
        "0",
        "1.00",
        "2.00",
        "100.00",
        "100.00",
        "200.00",
        "200.00",
        "300.00",
        "300.00",
    ]
    assert rows[4].split() == [
        "unlimited",
        "1",
        "0",
        "2.00",
        "4.00",
        "n/a",
        "n/a",
        "n/a",
        "n/a",
        "500.00",
        "500.00",
    ]


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


# ---- HTTP client against canned answers ----
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def canned(handler: Handler, coro: Callable[[aiohttp.ClientSession, str], Awaitable[Any]]) -> Any:
    """`coro(client, base_url)` with the benchmark's own session, against a real HTTP server on
    127.0.0.1 where `handler` answers every request."""

    async def go() -> Any:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", handler)
        async with TestServer(app, host="127.0.0.1") as server, bench_clients.open_session(5.0) as client:
            return await coro(client, f"http://127.0.0.1:{server.port}")

    return asyncio.run(go())


def sse_result(body: str, status: int = 200, backend: str = "srt", stream: bool = True) -> Any:
    """run_one against a canned answer, sent in 7-byte pieces of a chunked body so that lines and
    events straddle the pieces; the request sent is kept in `.sent`."""
    sent: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        sent.append({"path": request.path, **await request.json()})
        response = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        data = body.encode()
        for i in range(0, len(data), 7):
            await response.write(data[i : i + 7])
            await asyncio.sleep(0.001)  # the client reads it piece by piece
        await response.write_eof()
        return response

    def run(client: aiohttp.ClientSession, base_url: str) -> Awaitable[Any]:
        target = bench_clients.Target(backend, base_url, "m" if backend == "openai" else None)
        return bench_clients.run_one(client, target, [11, 12], 2, stream, 5.0, None)

    result = canned(handler, run)
    result.sent = sent[0]
    return result


def test_lines_are_split_across_pieces_and_unbounded() -> None:
    async def pieces(*chunks: bytes) -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def lines(*chunks: bytes) -> list[bytes]:
        return [line async for line in bench_clients._lines(pieces(*chunks))]

    assert asyncio.run(lines(b"da", b"ta: 1\r\n\nda", b"ta: 2", b"\n", b"", b"tail")) == [
        b"data: 1\r",
        b"",
        b"data: 2",
        b"tail",
    ]
    long_line = b"x" * (1 << 20)  # past aiohttp's own line limit
    assert asyncio.run(lines(*[long_line[i : i + 4096] for i in range(0, len(long_line), 4096)], b"\n")) == [
        long_line
    ]
    assert asyncio.run(lines()) == []


def chunk(ids: list[int], finish: str | None = None, total: int | None = None) -> str:
    meta: dict[str, Any] = {"finish_reason": {"type": finish} if finish else None}
    if total is not None:
        meta["completion_tokens"] = total
    return f"data: {json.dumps({'text': '', 'output_ids': ids, 'meta_info': meta})}\n\n"


def test_srt_stream_parsing_records_chunks_and_failures() -> None:
    ok = sse_result(chunk([5]) + chunk([5, 6, 7], "length") + "data: [DONE]\n\n")
    assert (
        ok.success and ok.output_len == 3 and ok.chunk_tokens == [1, 2] and ok.latency >= ok.chunk_times[-1]
    )
    assert ok.sent == {
        "path": "/generate",
        "input_ids": [11, 12],
        "stream": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
    }
    # --incremental-streaming-output: each chunk has only its new ids; completion_tokens is the total
    deltas = sse_result(
        chunk([5], total=1) + chunk([6, 7], total=3) + chunk([8], "length", total=4) + "data: [DONE]\n\n"
    )
    assert deltas.success and deltas.output_len == 4 and deltas.chunk_tokens == [1, 2, 1], deltas
    mid_error = sse_result(
        chunk([5]) + 'data: {"error": {"message": "rank died", "code": 503}}\n\ndata: [DONE]\n\n'
    )
    assert not mid_error.success and mid_error.error == "stream error: rank died"
    truncated = sse_result(chunk([5]))
    assert not truncated.success and "without data: [DONE]" in truncated.error
    aborted = sse_result(chunk([5], "abort") + "data: [DONE]\n\n")
    assert not aborted.success and "finish_reason 'abort'" in aborted.error
    rejected = sse_result('{"error": {"message": "prompt too long"}}', status=400)
    assert (
        not rejected.success
        and rejected.error.startswith("HTTP 400:")
        and "prompt too long" in rejected.error
    )
    garbled = sse_result("data: {not json\n\n")  # orjson's JSONDecodeError, or json's without orjson
    assert not garbled.success and garbled.error.startswith("JSONDecodeError:"), garbled.error


def completion_chunk(text: str, finish: str | None = None) -> str:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': finish}]})}\n\n"


def test_openai_stream_counts_chunks_and_takes_the_length_from_usage() -> None:
    usage = 'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}\n\n'
    ok = sse_result(
        completion_chunk("a")
        + completion_chunk("")
        + completion_chunk("bc", "length")
        + usage
        + "data: [DONE]\n\n",
        backend="openai",
    )
    assert ok.success and ok.output_len == 3 and ok.chunk_tokens == [1, 1, 1], ok
    assert ok.sent == {
        "path": "/v1/completions",
        "model": "m",
        "prompt": [11, 12],
        "max_tokens": 2,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    no_usage = sse_result(
        completion_chunk("a") + completion_chunk("b", "stop") + "data: [DONE]\n\n", backend="openai"
    )
    assert no_usage.success and no_usage.output_len == 2
    aborted = sse_result(completion_chunk("a", "abort") + "data: [DONE]\n\n", backend="openai")
    assert not aborted.success and "finish_reason 'abort'" in aborted.error
    error = sse_result('data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n', backend="openai")
    assert not error.success and error.error == "stream error: boom"
    plain = sse_result(
        json.dumps(
            {"choices": [{"text": "ab", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}
        ),
        backend="openai",
        stream=False,
    )
    assert plain.success and plain.output_len == 2 and plain.chunk_times == []


def test_auto_backend_is_srt_only_when_server_info_names_a_vocab_size() -> None:
    def server(routes: dict[str, Any]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            body = routes.get(request.path)
            return web.Response(status=404, text="Not Found") if body is None else web.json_response(body)

        return handler

    def resolve(routes: dict[str, Any], **kwargs: Any) -> tuple[tuple[bench_clients.Target, int | None], str]:
        """resolve_target's answer, and the server's base URL."""

        async def run(client: aiohttp.ClientSession, base_url: str) -> Any:
            return await bench_clients.resolve_target(client, base_url, **kwargs), base_url

        return canned(server(routes), run)

    srt_routes = {"/server_info": {"vocab_size": 320}, "/v1/models": {"data": [{"id": "tiny"}]}}
    answer, base = resolve(srt_routes)
    assert answer == (bench_clients.Target("srt", base, None), 320)
    answer, base = resolve(srt_routes, backend="openai")
    assert answer == (bench_clients.Target("openai", base, "tiny"), 320)
    vllm_like = {"/v1/models": {"object": "list", "data": [{"id": "org/model"}]}}
    (target, vocab), base = resolve(vllm_like)
    assert (target.backend, target.model, target.url, vocab) == (
        "openai",
        "org/model",
        f"{base}/v1/completions",
        None,
    )
    assert resolve(vllm_like, model="other")[0][0].model == "other"
    with pytest.raises(ValueError, match="lists no model"):
        resolve({"/v1/models": {"data": []}})


def test_http_call_returns_every_status_and_raises_only_when_unreachable() -> None:
    seen: list[tuple[str, str, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.method, request.path, await request.json() if request.can_read_body else None))
        if request.path == "/missing":
            return web.Response(status=404, text="no such route")
        return web.json_response({"ok": True})

    async def calls(client: aiohttp.ClientSession, base_url: str) -> tuple[Any, Any]:
        return (
            await asyncio.to_thread(bench_clients.http_call, f"{base_url}/missing", 5.0),
            await asyncio.to_thread(bench_clients.http_call, f"{base_url}/generate", 5.0, {"input_ids": [1]}),
        )

    missing, posted = canned(handler, calls)
    assert (missing.status, missing.text) == (404, "no such route")
    assert posted.status == 200 and posted.json() == {"ok": True}
    assert seen == [("GET", "/missing", None), ("POST", "/generate", {"input_ids": [1]})]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(bench_clients.HTTP_ERRORS):
        bench_clients.http_call(f"{closed}/health", 5.0)


def test_unreachable_server_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert bench.main(["--base-url", closed, "--num-prompts", "1"]) == 1
    assert f"cannot reach the server at {closed}: ClientConnectorError" in capsys.readouterr().err


def test_bad_arguments_are_usage_errors() -> None:
    for argv, message in (
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--concurrency", "4", "0"], "--concurrency values must be >= 1"),
        (["--backend", "grpc"], "invalid choice: 'grpc'"),
    ):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ---- end to end: one server for the module ----
@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        str(smollm2_dir),
        "--max-total-tokens",
        "4096",
        startup_timeout=90,
    ) as server:
        yield server


def run_bench(server: Server, cwd: Path, *argv: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--base-url",
            server.url,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--request-timeout",
            "60",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def sweep_rows(out: str) -> dict[str, list[str]]:
    """The sweep table's rows by concurrency label."""
    table = out[out.index("concurrency  completed") :].splitlines()[2:]
    return {row.split()[0]: row.split()[1:] for row in table if re.match(r"^\s+(\d+|unlimited)\s", row)}


@pytest.mark.timeout(180)
def test_sweep_against_a_real_server_prints_the_table_and_plots(server: Server, tmp_path: Path) -> None:
    import matplotlib.image

    out = run_bench(server, tmp_path, "--concurrency", "1", "4", "--plot", "sweep.png", "--json", "out.json")
    assert "vocab 320" in out, out  # read from /server_info: ids stay inside the tiny vocabulary
    assert "backend srt (" in out, out  # auto-detected: the server is srt
    assert len(re.findall(r"^Successful requests:\s+8$", out, re.MULTILINE)) == 2, out
    assert len(re.findall(r"^Total generated tokens:\s+64$", out, re.MULTILINE)) == 2, out
    rows = sweep_rows(out)
    assert list(rows) == ["1", "4"], out
    for cells in rows.values():
        assert cells[:2] == ["8", "0"], out  # completed, failed
        assert all(re.fullmatch(r"\d+\.\d\d", c) for c in cells[2:]), out
        # ITL p50 / p99 may print 0.00: with a tiny model two tokens' events can reach the client in one read
        req_s, tok_s, ttft_p50, ttft_p99, _, _, e2e_p50, e2e_p99 = map(float, cells[2:])
        assert min(req_s, tok_s, ttft_p50, ttft_p99, e2e_p50, e2e_p99) > 0, out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["backend"] == "srt" and [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert (level["completed"], level["failed"], level["errors"]) == (8, 0, [])
        assert level["total_input_tokens"] == 8 * 16 and level["output_lens"] == [8] * 8
        assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.01  # something was drawn


@pytest.mark.timeout(120)
def test_openai_backend_against_the_servers_completions_route(server: Server, tmp_path: Path) -> None:
    out = run_bench(server, tmp_path, "--backend", "openai", "--concurrency", "4", "--json", "out.json")
    assert "backend openai (" in out and "/v1/completions" in out, out
    assert re.search(r"^Successful requests:\s+8$", out, re.MULTILINE), out
    assert re.search(r"^Total generated tokens:\s+64$", out, re.MULTILINE), (
        out
    )  # from usage.completion_tokens
    assert sweep_rows(out)["4"][:2] == ["8", "0"], out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["backend"] == "openai" and report["model"], report  # named by /v1/models
    level = report["levels"][0]
    assert level["output_lens"] == [8] * 8 and 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    assert level["itl_ms"]["p50"] > 0


@pytest.mark.timeout(120)
def test_one_level_api_used_by_bench_guards(server: Server) -> None:
    args = bench.parse_args(
        [
            "--base-url",
            server.url,
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            "--max-concurrency",
            "2",
            "--request-timeout",
            "60",
        ]
    )
    assert args.concurrency == [2]
    m, details = asyncio.run(bench.benchmark(args))
    assert (m.completed, m.failed, m.total_output_tokens) == (4, 0, 16)
    assert details["concurrency"] == 2 and details["vocab_size"] == 320 and m.itl_ms is not None
    with pytest.raises(ValueError, match="one concurrency level"):
        asyncio.run(bench.benchmark(bench.parse_args(["--base-url", server.url, "--concurrency", "1", "2"])))
