"""scripts/soak.py: its judgements fed bad answers and bad samples (each must fail the soak), and a
short soak of a real server on a tiny model, run as a user runs it (a subprocess, with --url)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixture import Server

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "soak.py"
sys.path.insert(0, str(SCRIPT.parent))  # scripts/ is not a package

import soak  # noqa: E402
import soak_report as report  # noqa: E402
from soak_report import Record  # noqa: E402

KINDS = ["generate", "stream", "openai", "dropped", "abort", "bad"]  # soak.py's


# ---- judgements ----
def test_a_bad_request_must_be_a_400_naming_its_parameter() -> None:
    assert report.judge_refusal(400, {"error": {"param": "top_p"}}, "top_p") == (report.REFUSED_400, "")
    assert report.judge_refusal(400, {"error": {"param": None}}, None) == (report.REFUSED_400, "")
    assert report.judge_refusal(400, {"error": {"param": None}}, "top_p")[0] == report.WRONG_PARAM_400
    assert report.judge_refusal(400, "not json", "top_p")[0] == report.WRONG_PARAM_400
    assert report.judge_refusal(200, {"text": ""}, "top_p")[0] == report.ACCEPTED_BAD
    assert report.judge_refusal(500, {}, "top_p")[0] == report.SERVER_ERROR
    assert report.judge_refusal(401, {}, "top_p")[0] == report.OTHER_4XX


def out(finish: dict[str, object] | None, completion: int) -> dict[str, object]:
    return {"output_ids": [], "meta_info": {"finish_reason": finish, "completion_tokens": completion}}


def test_a_completion_must_end_with_a_finish_reason_that_fits_it() -> None:
    length, stop, abort = {"type": "length"}, {"type": "stop"}, {"type": "abort", "message": "x"}
    assert report.judge_generate(out(length, 8), 8, 8) == (report.OK, "")
    assert report.judge_generate(out(stop, 3), 8, 3) == (report.OK, "")
    assert report.judge_generate(out(None, 3), 8, 3)[0] == report.WRONG_FINISH
    assert report.judge_generate(out(length, 5), 8, 5)[0] == report.WRONG_FINISH  # length before max
    assert report.judge_generate(out(stop, 9), 8, 9)[0] == report.WRONG_FINISH  # past max_new_tokens
    assert report.judge_generate(out(abort, 3), 8, 3)[0] == report.WRONG_FINISH  # nobody aborted it
    assert report.judge_generate(out(length, 8), 8, 7)[0] == report.MALFORMED_RESPONSE  # an id lost
    assert report.judge_generate({"text": ""}, 8, 0)[0] == report.MALFORMED_RESPONSE
    assert report.judge_generate(out(abort, 3), 8, 3, abort_sent=True) == (report.ABORTED, "")
    assert report.judge_generate(out(length, 8), 8, 8, abort_sent=True)[0] == report.ABORT_TOO_LATE
    assert report.judge_completion("length", {"completion_tokens": 4}, 4) == (report.OK, "")
    assert report.judge_completion(None, {"completion_tokens": 4}, 4)[0] == report.WRONG_FINISH
    assert report.judge_completion("length", {"completion_tokens": 3}, 4)[0] == report.WRONG_FINISH
    assert report.judge_completion("stop", None, 4)[0] == report.MALFORMED_RESPONSE


def test_a_stream_must_be_data_events_ending_with_done() -> None:
    pieces = [b'data: {"a"', b": 1}\r\n\r\nda", b'ta: {"b": 2}\n\ndata: [DONE]\n\n']
    assert list(report.sse_events(report.lines_of(pieces))) == [{"a": 1}, {"b": 2}, report.DONE]
    for bad, why in (
        ([b"data: {not json"], "not JSON"),
        ([b"event: x"], "not an SSE data line"),
        ([b"data: [DONE]", b'data: {"a": 1}'], "data after"),
    ):
        with pytest.raises(report.MalformedStream, match=why):
            list(report.sse_events(bad))
    assert report.stream_error({"error": {"code": 503, "message": "busy"}})[0] == report.BUSY
    assert report.stream_error({"error": {"message": "boom"}})[0] == report.SERVER_ERROR
    assert report.stream_error({"text": ""}) is None


def test_unexpected_outcomes_are_marked_in_the_table() -> None:
    records = [
        Record("generate", report.OK, 1.0, e2e_s=0.2, prompt="short"),
        Record("bad", report.REFUSED_400, 1.5),
        Record("stream", report.SERVER_ERROR, 2.0, prompt="long+prefix", detail="error event: boom"),
        Record("stream", report.BUSY, 2.5, prompt="short", detail="queue full"),
    ]
    table = report.outcome_table(records, KINDS, report.EXPECTED)
    rows = {line.split()[0]: line for line in table.splitlines() if not line.startswith(" ")}  # no details
    assert rows["ok"].split()[1:] == ["1", "1", "0", "0", "0", "0", "0", "expected"], rows
    assert rows["5xx"].split()[1:] == ["1", "0", "1", "0", "0", "0", "0", "UNEXPECTED"], rows
    assert rows["503"].endswith("UNEXPECTED")  # the server promised no 503
    assert "  5xx (stream, long+prefix prompt): error event: boom" in table
    assert report.BUSY not in report.expected_outcomes({"max_queued_requests": None})
    assert report.BUSY in report.expected_outcomes({"max_queued_requests": 4})
    assert report.BUSY in report.expected_outcomes({"req_waiting_timeout": 2.0})


def test_latency_rows_take_the_requests_that_ended_in_the_interval() -> None:
    records = [Record("generate", report.OK, t, e2e_s=t / 10) for t in (1.0, 2.0, 3.0, 6.0)]
    records += [Record("stream", report.MALFORMED_STREAM, 4.0, ttft_s=0.05)]
    row = report.interval_row(records, 0.0, 5.0, report.EXPECTED)
    assert (row["requests"], row["unexpected"]) == (4, 1)
    assert row["e2e_p50_ms"] == pytest.approx(200.0) and row["e2e_p99_ms"] == pytest.approx(298.0)
    assert row["ttft_p50_ms"] == pytest.approx(50.0)
    empty = report.interval_row(records, 6.0, 10.0, report.EXPECTED)
    assert empty["requests"] == 0 and empty["e2e_p50_ms"] is None


def state(**changes: object) -> dict[str, object]:
    """An idle server's internal state with 10 of its 100 KV pages in the prefix cache."""
    idle = {"running": [], "waiting": [], "chunked": None, "kv_integrity_error": None}
    return {**idle, "free_pages": 90, "cached_pages": 10, "used_pages": 10, "num_pages": 100, **changes}


def test_leaked_kv_pages_fail_the_integrity_check() -> None:
    flushed = state(free_pages=100, cached_pages=0, used_pages=0)
    assert report.kv_problems(state(), flushed) == []
    assert report.kv_problems(state(), None) == []  # --no-flush
    assert report.kv_problems(state(free_pages=88), flushed) == [
        "idle: 88 free + 10 cached pages != 100 pages (2 leaked)"
    ]
    problems = report.kv_problems(state(kv_integrity_error="3 KV pages are held by two owners"), flushed)
    assert problems == ["idle: the server's own check: 3 KV pages are held by two owners"]
    problems = report.kv_problems(state(), state(free_pages=99, cached_pages=0, used_pages=1))
    assert problems == [
        "after /flush_cache: 99 free + 0 cached pages != 100 pages (1 leaked)",
        "after /flush_cache: 1 pages still used, 99 of 100 free",
    ]
    assert "the server was not idle" in report.kv_problems(state(running=["r1"]), flushed)


def test_a_replaced_or_vanished_process_fails_the_soak() -> None:
    first = {
        "processes": {
            "main": {"pid": 1, "rss_bytes": 100 << 20},
            "scheduler TP0": {"pid": 2, "rss_bytes": 1 << 30},
        }
    }
    assert report.process_problems(first, first) == []
    last = {
        "processes": {
            "main": {"pid": 1, "rss_bytes": 110 << 20},
            "scheduler TP0": {"pid": 3, "rss_bytes": 1 << 30},
        }
    }
    assert report.process_problems(first, last) == ["process scheduler TP0 was replaced (pid 2 -> 3)"]
    gone = {"processes": {"main": {"pid": 1, "rss_bytes": 1}}}
    assert report.process_problems(first, gone) == ["process scheduler TP0 (pid 2) is gone"]
    table = report.rss_table(first, last).splitlines()
    assert table[1].split() == ["main", "1", "100", "110", "+10"]
    assert table[2].split() == ["scheduler", "TP0", "2->3", "1024", "1024", "+0"]
    text = 'srt:engine_restarts_total 2.0\nsrt:engine_restarts_created 1.7e9\nx{a="1"} 3\nx{a="2"} 4\n'
    assert report.metric_total(text, "srt:engine_restarts_total") == 2.0
    assert report.metric_total(text, "x") == 7.0 and report.metric_total(text, "y") is None


def test_prompts_stay_within_the_lengths_asked() -> None:
    rng = random.Random(0)
    prompts = soak.Prompts(49152, 8192, rng, min_tokens=16, max_tokens=4000)
    made = [prompts.make(rng, rng.choice([8, 64, 256])) for _ in range(2000)]
    lengths = [len(ids) for ids, _, _ in made]
    assert min(lengths) >= 16 and max(lengths) == 4000, (min(lengths), max(lengths))
    assert {shape for _, shape, _ in made} == {"short", "medium", "long"} | {
        s + "+prefix" for s in ("short", "medium", "long")
    }
    assert all(100 <= i < 49152 for ids, _, _ in made for i in ids)
    # a limit below the longest prompt asked caps it, new tokens included
    tight = soak.Prompts(49152, 512, rng, min_tokens=16, max_tokens=4000)
    assert all(
        16 <= len(ids) and len(ids) + new <= 512 for ids, _, new in (tight.make(rng, 64) for _ in range(500))
    )


def samples_of(rss_mb: dict[str, list[float]], every_s: float = 60.0) -> list[dict[str, object]]:
    """One sample per interval with each process's RSS (MB) from `rss_mb`, as soak.py samples."""
    n = len(next(iter(rss_mb.values())))
    return [
        {
            "t_s": i * every_s,
            "processes": {
                name: {"pid": 1 + k, "rss_bytes": int(values[i] * report.MB)}
                for k, (name, values) in enumerate(rss_mb.items())
            },
        }
        for i in range(n)
    ]


def test_memory_passes_only_when_every_process_levels_off_under_its_bound() -> None:
    kv, margin = 256 * report.MB, 100 * report.MB
    # 0..600 s: the rank fills its KV cache in the first half, then holds (within 5%); main is flat
    plateau = {
        "main": [380.0] * 11,
        "scheduler TP0": [860, 1000, 1100, 1150, 1160, 1165, 1170, 1180, 1190, 1200, 1195],
    }
    verdict = report.rss_verdict(samples_of(plateau), kv, margin, 5.0)
    assert verdict["half_t_s"] == 300 and verdict["problems"] == [], verdict
    rank = verdict["rows"][1]
    assert (rank["half"], rank["peak"]) == (1165 * report.MB, 1200 * report.MB)
    assert rank["growth"] == 35 * report.MB and rank["bound"] == (860 + 256 + 100) * report.MB
    # the soak of issue 36: still rising 40-50 MB a minute at the end
    rising = {**plateau, "scheduler TP0": [856, 1354, 1398, 1534, 1669, 1750, 1804, 1838, 1882, 1924, 1975]}
    problems = report.rss_verdict(samples_of(rising), kv, 10_000 * report.MB, 5.0)["problems"]
    assert problems == ["scheduler TP0 grew 225 MB (12.9%) over the last half, more than 5%"]
    # flat at the end but above the start + KV + margin; the main process has no KV allowance
    high = {"main": [380, 500, 500, 500, 500, 500], "scheduler TP0": [860, 1300, 1300, 1300, 1300, 1300]}
    problems = report.rss_verdict(samples_of(high), kv, margin, 5.0)["problems"]
    assert problems == [
        "main reached 500 MB, above its bound of 480 MB",
        "scheduler TP0 reached 1300 MB, above its bound of 1216 MB",
    ]
    assert report.rss_verdict(samples_of(high), kv, None, 5.0)["problems"] == []  # no bound without a margin
    table = report.rss_verdict_table(report.rss_verdict(samples_of(rising), kv, None, 5.0)).splitlines()
    assert table[2].split()[-5:] == ["1975", "+225", "(+12.9%)", "-", "GROWING"], table


# ---- a short soak of a real server ----
@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(tiny_model_dirs["llama"]),  # context 512: the long prompts are 200-500 tokens
        "--tokenizer-path",
        str(smollm2_dir),
        "--max-total-tokens",
        "4096",
        "--enable-metrics",
        startup_timeout=90,
    ) as server:
        yield server


@pytest.mark.slow  # the default run is at its 20-minute line
@pytest.mark.timeout(180)
def test_a_short_soak_of_a_running_server_is_clean(server: Server, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--url",
            server.url,
            "--minutes",
            "0.4",
            "--interval",
            "4",
            "--concurrency",
            "4",
            "--request-timeout",
            "60",
            "--idle-timeout",
            "30",
            "--json-out",
            "soak.json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    result = json.loads((tmp_path / "soak.json").read_text())
    outcomes = result["outcomes"]
    assert {kind for by_kind in outcomes.values() for kind in by_kind} == set(KINDS), outcomes
    assert set(outcomes) <= set(result["expected_outcomes"]) and result["unexpected"] == 0, outcomes
    assert {report.OK, report.REFUSED_400, report.DROPPED, report.ABORTED} <= set(outcomes), outcomes
    for kind in ("generate", "stream", "openai"):
        assert outcomes[report.OK].get(kind, 0) > 0, outcomes
    shapes = result["prompt_shapes"]
    for shape in ("short", "medium", "long"):
        assert any(s.startswith(shape) for s in shapes), shapes
    assert any(s.endswith("+prefix") for s in shapes), shapes
    # the printed outcome table: every row expected
    table = out[out.index("Outcomes by traffic kind:") :].splitlines()[1:]
    assert table[0].split() == ["outcome", "total", *KINDS, "judged"], out
    rows = [line for line in table[1:] if re.search(r"\s(expected|UNEXPECTED)$", line)]
    assert len(rows) == len(outcomes) and all(line.endswith(" expected") for line in rows), out
    # the over-time table: rows of latency, with requests ended in them
    over_time = re.findall(
        r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+|-)\s+(\d+|-)\s+(\d+|-)\s+(\d+|-)\s+\d+/\d+\s", out, re.M
    )
    assert all(row[2] == "0" for row in over_time), out  # no unexpected outcome in any interval
    assert len([row for row in over_time if int(row[1]) > 0 and row[3] != "-"]) >= 4, out
    assert re.search(r"^main\s+\d+\s+\d+\s+\d+\s+[+-]\d+$", out, re.M), out  # RSS at start and end
    assert "KV integrity: ok" in out and "processes: ok" in out, out
    flushed = result["flushed_state"]
    assert flushed["free_pages"] == flushed["num_pages"] and result["kv_problems"] == [], result
    assert result["engine_restarts"] == 0  # read from /metrics (--enable-metrics)


@pytest.mark.slow  # ~17 s; a soak against a running server stays in the default run
@pytest.mark.timeout(180)
def test_the_soak_starts_its_own_server_and_passes_the_api_key(
    tiny_model_dirs: dict[str, Path], smollm2_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--minutes",
            "0.1",
            "--interval",
            "3",
            "--concurrency",
            "2",
            "--request-timeout",
            "60",
            "--startup-timeout",
            "90",
            "--",
            "--model-path",
            str(tiny_model_dirs["qwen2"]),
            "--tokenizer-path",
            str(smollm2_dir),
            "--max-total-tokens",
            "1024",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
        env={**os.environ, "SRT_API_KEY": "soak-secret"},  # the server requires it; the soak sends it
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "KV cache budget: " in out and "(no KV budget line" not in out, out  # from its server's log
    assert "prompts up to 512 tokens" in out, out  # the context (512) is below the KV cache (1024)
    assert "KV integrity: ok" in out and "processes: ok" in out, out
    assert "soak-secret" not in out + proc.stderr
