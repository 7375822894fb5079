"""--enable-metrics and the stats log, on one real TP=2 server (tiny Llama, 8k positions): /metrics parses as
Prometheus text and its series move with the requests (counters by finish reason, tokens,
latency histograms, every rank's forward steps and last-step time, the output rank's gauges);
the output rank alone prints SGLang's prefill / decode stats lines; every log line names its
process. Without the flag /metrics is a 404 (test_server_e2e.py)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import Server

from srt.metrics import SGLANG_MIRRORED

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PROMPT = [(11 * i + 5) % 300 + 10 for i in range(24)]


@pytest.fixture(scope="module")
def server(long_context_llama: Path, smollm2_dir: Path) -> Iterator[Server]:
    with Server(
        "--model-path",
        str(long_context_llama),
        "--tokenizer-path",
        str(smollm2_dir),
        "--tp",
        "2",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        "--enable-metrics",
        "--decode-log-interval",
        "3",
    ) as server:
        yield server


def scrape(server: Server) -> Samples:
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def generate(server: Server, ids: list[int], max_new: int = 6, **params: Any) -> dict[str, Any]:
    r = server.generate(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **params},
        }
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def wait_for(server: Server, predicate: Any, timeout: float = 20.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if predicate(samples):
            return samples
        assert time.monotonic() < deadline, {k: v for k, v in samples.items() if "bucket" not in k[0]}
        time.sleep(0.1)


def test_series_move_after_requests(server: Server) -> None:
    before, started = scrape(server), time.time()
    outs = [generate(server, PROMPT), generate(server, PROMPT), generate(server, PROMPT[:10], max_new=9)]
    stop_at = outs[0]["output_ids"][2]
    outs.append(generate(server, PROMPT, stop_token_ids=[stop_at]))
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    # rank 1 publishes its last step's count a moment after rank 0 may report the queue empty
    after = wait_for(
        server,
        lambda s: (
            value(s, "srt:num_running_reqs") == 0
            and value(s, "srt:num_queue_reqs") == 0
            and value(s, "srt:forward_steps_total", rank="0") == value(s, "srt:forward_steps_total", rank="1")
        ),
    )

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    metas = [out["meta_info"] for out in outs]
    assert delta("srt:num_requests_total", finish_reason="length") == 3
    assert delta("srt:num_requests_total", finish_reason="stop") == 1
    assert delta("srt:prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert delta("srt:generation_tokens_total") == sum(m["completion_tokens"] for m in metas) == 6 + 6 + 9 + 3
    assert delta("srt:cached_tokens_total") == sum(m["cached_tokens"] for m in metas) > 0
    assert delta("srt:time_to_first_token_seconds_count") == 4
    assert delta("srt:e2e_request_latency_seconds_count") == 4
    assert delta("srt:e2e_request_latency_seconds_sum") > 0
    assert delta("srt:inter_token_latency_seconds_count") == sum(m["completion_tokens"] - 1 for m in metas)
    # Every rank runs every step; the last one just now.
    steps = [delta("srt:forward_steps_total", rank=str(r)) for r in (0, 1)]
    assert steps[0] == steps[1] >= 4 + 5 + 5 + 8 + 2
    for rank in ("0", "1"):
        assert value(after, "srt:last_forward_step_timestamp_seconds", rank=rank) >= started
    assert 0 < value(after, "srt:cache_hit_rate") < 1
    assert value(after, "srt:num_used_tokens") == 0 and value(after, "srt:token_usage") == 0


def test_gauges_follow_a_running_request(server: Server) -> None:
    body = {
        "input_ids": PROMPT,
        "rid": "long-one",
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True},
    }
    before = scrape(server)
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(server.generate(body).json()))
    worker.start()
    busy = wait_for(server, lambda s: value(s, "srt:num_running_reqs") == 1)
    assert value(busy, "srt:num_used_tokens") >= len(PROMPT) and 0 < value(busy, "srt:token_usage") < 1
    requests.post(server.url + "/abort_request", json={"rid": "long-one"}, timeout=10)
    worker.join(30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    after = wait_for(server, lambda s: value(s, "srt:num_running_reqs") == 0)
    assert (
        value(after, "srt:num_requests_total", finish_reason="abort")
        == value(before, "srt:num_requests_total", finish_reason="abort") + 1
    )


def test_the_series_under_sglangs_names(server: Server, long_context_llama: Path) -> None:
    """What a router, autoscaler or dashboard built for SGLang reads: the same values under
    sglang:<name>, labelled with the model's name as SGLang labels them."""
    generate(server, PROMPT)
    samples = wait_for(server, lambda s: value(s, "srt:num_running_reqs") == 0)
    model = str(long_context_llama)  # --model-path as given names the model (no --served-model-name)
    mirrored = [
        (name, labels)
        for name, labels in samples
        if name.startswith("srt:")
        and name.removeprefix("srt:")
        .removesuffix("_total")
        .removesuffix("_count")
        .removesuffix("_sum")
        .removesuffix("_bucket")
        .removesuffix("_created")
        in SGLANG_MIRRORED
    ]
    assert len({name for name, _ in mirrored}) >= 20
    for name, labels in mirrored:
        twin = value(samples, "sglang:" + name.removeprefix("srt:"), **dict(labels), model_name=model)
        assert twin == samples[(name, labels)], name
    assert value(samples, "sglang:num_requests_total", finish_reason="length", model_name=model) > 0
    assert value(samples, "sglang:max_total_num_tokens", model_name=model) == 4096


LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (main|scheduler_TP\d+|detokenizer)\] [A-Z]+ ")
DECODE_LINE = re.compile(
    r"\[\S+ \S+ scheduler_TP0\] INFO srt\.scheduler: Decode batch\. #running-req: (\d+), "
    r"#token: (\d+), token usage: (\d\.\d\d), gen throughput \(token/s\): (\d+\.\d\d), "
    r"#queue-req: (\d+)$"
)
PREFILL_LINE = re.compile(
    r"\[\S+ \S+ scheduler_TP0\] INFO srt\.scheduler: Prefill batch\. #new-seq: \d+, "
    r"#new-token: \d+, #cached-token: \d+, token usage: \d\.\d\d, #running-req: \d+, "
    r"#queue-req: \d+$"
)


def test_stats_log_lines_come_from_the_output_rank(server: Server) -> None:
    generate(server, PROMPT[5:], max_new=12)
    lines = server.output().splitlines()
    decode = [m for m in map(DECODE_LINE.search, lines) if m]
    assert decode and all(int(m[1]) >= 1 and int(m[2]) > 0 and float(m[4]) > 0 for m in decode)
    assert any(map(PREFILL_LINE.search, lines))
    assert not [ln for ln in lines if "batch. #" in ln and "scheduler_TP0" not in ln]  # TP1 stays quiet
    # Every log line (uvicorn's included) names the process that wrote it.
    unlabelled = [
        ln
        for ln in lines
        if re.search(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b", ln) and not LOG_LINE.match(ln)
    ]
    assert not unlabelled, unlabelled[:5]
