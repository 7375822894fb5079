"""--restart-on-failure: a lost rank restarts the engine and every stream continues exactly.

One server (TP=2, tiny Llama, fp32) goes through four failures in a row while 8 streams (greedy
and seeded, one with logprobs) run: SIGKILL of rank 1, then a `raise`, a `stall` (short hard
watchdog) and a `diverge_batch` (consensus checker on), one per engine start. A second server
crashes at every start and goes down, loudly, after its restarts are spent.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from server_fixture import Server
from test_guards_e2e import assert_tree_gone, rank_pid, remember_tree, server_args, wait_exit

from model_executor.cpu.kernels import build
from scheduler.fault_injection import FaultInjector, parse_faults
from srt.io_struct import ResumeState, TokenizedGenerateReq
from srt.recovery import RestartBudget
from srt.sampling_params import SamplingParams
from srt.tokenizer_manager import ReqState

MAX_NEW_TOKENS = 160
STEP = 8  # the injected faults fire at this forward step of their engine start


def payloads() -> list[dict[str, Any]]:
    out = []
    for i in range(8):
        params: dict[str, Any] = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        params.update(
            {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        )
        body: dict[str, Any] = {"input_ids": list(range(5 + 3 * i, 30 + 2 * i)), "sampling_params": params}
        if i == 0:
            body["return_logprob"] = True
        out.append(body)
    return out


# ---------------------------------------------------------------- units


def test_faults_can_be_limited_to_one_engine_start() -> None:
    assert parse_faults("raise@1:5/2,crash@0:0") == [
        parse_faults("raise@1:5/2")[0],
        parse_faults("crash@0:0")[0],
    ]
    assert parse_faults("raise@1:5/2")[0].start == 2 and parse_faults("crash@0:0")[0].start is None
    assert FaultInjector(1, "raise@1:5/2", engine_start=2).active
    assert not FaultInjector(1, "raise@1:5/2", engine_start=0).active
    assert FaultInjector(1, "crash@1:3", engine_start=7).active  # no start: every start (a crash loop)
    with pytest.raises(ValueError, match="KIND@RANK:STEP"):
        parse_faults("raise@1:5/x")


def test_restart_budget_counts_within_the_window() -> None:
    now = [0.0]
    budget = RestartBudget(2, 10.0, clock=lambda: now[0])
    assert budget.take() and budget.take() and not budget.take()
    now[0] = 10.5  # both restarts have left the window
    assert budget.take() and budget.describe() == "restart 1 of at most 2 within 10 s"


def test_a_replay_continues_after_what_the_client_has() -> None:
    sent = TokenizedGenerateReq("r", [1, 2, 3], SamplingParams(max_new_tokens=9, seed=5), seed=5, stream=True)
    state = ReqState("r", 3, None, None, sent=sent)  # type: ignore[arg-type]
    assert state.replay() is sent  # nothing delivered yet: the request as it was
    state.output_ids, state.text = [7, 8], "ab"
    replay = state.replay()
    assert replay.input_ids == [1, 2, 3] and replay.seed == 5 and replay.resume == ResumeState([7, 8], 2)


# ---------------------------------------------------------------- end to end


def stream(
    server: Server, body: dict[str, Any], progress: list[int]
) -> tuple[list[int], str, list[Any], Any]:
    """Stream to the end; every update must extend the last one (nothing dropped or repeated)."""
    ids: list[int] = []
    text, meta, logprobs = "", None, []
    with requests.post(
        server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=300
    ) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if not line:
                continue
            assert isinstance(line, str) and line.startswith("data: ")
            if line == "data: [DONE]":
                break
            out = json.loads(line[6:])
            assert "error" not in out, out
            assert out["output_ids"][: len(ids)] == ids and out["text"].startswith(text)
            ids, text, meta = out["output_ids"], out["text"], out["meta_info"]
            logprobs = meta.get("output_token_logprobs", [])
            progress[0] = len(ids)
    return ids, text, logprobs, meta


class HealthWatch(threading.Thread):
    """Polls /health; on the first 503 sends a new request, which must wait and then succeed."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.saw_503 = False
        self.held_back: requests.Response | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                status = requests.get(self.server.url + "/health", timeout=5).status_code
            except requests.RequestException:
                status = 0
            if status == 503 and not self.saw_503:
                self.saw_503 = True
                body = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
                self.held_back = self.server.generate(body, timeout=300)
            time.sleep(0.05)


def wait_for(condition: Any, timeout: float, what: str, server: Server) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s:\n{server.output()[-4000:]}"
        time.sleep(0.05)


def streams_through_a_kill(
    server: Server,
    bodies: list[dict[str, Any]],
    victim: str | Callable[[], int],
    after: int = 2,
    timeout: float = 400,
) -> list[Any]:
    """Streams every body; once each has `after` tokens, SIGKILLs `victim` (the server's process of
    that title, or the pid it returns); waits for every stream to end (see `stream`)."""
    progress = [[0] for _ in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(stream, server, b, p) for b, p in zip(bodies, progress)]
        wait_for(lambda: all(p[0] >= after for p in progress), timeout, "every stream under way", server)
        os.kill(rank_pid(server, victim) if isinstance(victim, str) else victim(), signal.SIGKILL)
        return [f.result(timeout=timeout) for f in futures]


def test_streams_survive_sigkill_raise_stall_and_divergence(
    long_context_llama: Path, smollm2_dir: Path
) -> None:
    faults = f"raise@1:{STEP}/1,stall@1:{STEP}/2,diverge_batch@1:1/3"
    args = server_args(
        long_context_llama,
        smollm2_dir,
        "--restart-on-failure",
        "4",
        "--watchdog-timeout",
        "3",
        "--enable-rank-consensus-checker",
        "--enable-metrics",
    )
    with Server(*args, env={"SRT_TEST_FAULT": faults}) as server:
        bodies = payloads()
        with ThreadPoolExecutor(len(bodies)) as pool:  # the fault-free run (start 0 has no injected fault)
            expected = [r.json() for r in pool.map(lambda b: server.generate(b, timeout=300), bodies)]
        assert all(len(e["output_ids"]) == MAX_NEW_TOKENS for e in expected)
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200

        watch = HealthWatch(server)
        watch.start()
        results = streams_through_a_kill(server, bodies, "srt::scheduler_TP1")
        watch.stop.set()
        watch.join(10)

        out = server.output()
        for (ids, text, _, meta), want in zip(results, expected):
            assert ids == want["output_ids"], out[-3000:]
            assert text == want["text"] and meta["finish_reason"]["type"] == "length"
            assert meta["completion_tokens"] == MAX_NEW_TOKENS
        got_lp, want_lp = results[0][2], expected[0]["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]
        assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(got_lp, want_lp))
        assert server.proc.poll() is None
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        assert watch.saw_503 and watch.held_back is not None and watch.held_back.status_code == 200
        assert len(watch.held_back.json()["output_ids"]) == 4

        assert "scheduler TP1 (pid" in out and "killed by signal SIGKILL; restarting the engine" in out
        assert "fault injection: raise on rank 1" in out
        assert "hard watchdog fired" in out and "its hard watchdog fired" in out
        # The rank that admits one request fewer fails its next collective (gloo aborts on the shape
        # mismatch) or the checker reports the divergence first: either way the engine restarts.
        fourth = out[out.index("engine restarted in", out.index("its hard watchdog fired")) :]
        assert "restarting the engine (restart 4 of at most 4" in fourth, fourth[-3000:]
        assert out.count("engine restarted in") == 4, out[-4000:]
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert "srt:engine_restarts_total 4.0" in metrics
        assert "srt:replayed_requests_total" in metrics and "srt:recovery_seconds_count 4.0" in metrics


@pytest.mark.slow  # ~20 s; the default run keeps the TP restarts (raise, stall, divergence)
def test_pipeline_streams_survive_losing_stage_1(long_context_llama: Path, smollm2_dir: Path) -> None:
    """PP=2 (one rank a stage): SIGKILL of the last stage mid-stream restarts both stages and every
    stream ends with the tokens of a fault-free run (greedy and seeded)."""
    args = server_args(
        long_context_llama, smollm2_dir, "--tp", "1", "--pp-size", "2", "--restart-on-failure", "1"
    )
    bodies = payloads()[:4]
    with Server(*args) as server:
        with ThreadPoolExecutor(len(bodies)) as pool:
            expected = [r.json() for r in pool.map(lambda b: server.generate(b, timeout=300), bodies)]
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
        results = streams_through_a_kill(server, bodies, "srt::scheduler_PP1_TP0")
        out = server.output()
        for (ids, text, _, meta), want in zip(results, expected):
            assert ids == want["output_ids"] and text == want["text"], out[-3000:]
            assert meta["completion_tokens"] == MAX_NEW_TOKENS
        assert "scheduler PP1 TP0 (pid" in out and "killed by signal SIGKILL; restarting the engine" in out
        assert "engine restarted in" in out and server.proc.poll() is None


@pytest.mark.slow  # the restart path itself is covered by the test above on the default run
def test_a_crash_loop_goes_down_loudly_after_its_restarts(
    long_context_llama: Path, smollm2_dir: Path
) -> None:
    args = server_args(long_context_llama, smollm2_dir, "--restart-on-failure", "2")
    with Server(*args, env={"SRT_TEST_FAULT": "crash@1:3"}) as server:  # every start crashes at step 3
        remember_tree(server)
        with requests.post(
            server.url + "/generate", json={**payloads()[0], "stream": True}, stream=True, timeout=300
        ) as r:
            lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines[-3:]
        assert wait_exit(server, 60) != 0
        out = server.output()
        assert out.count("restarting the engine") == 2
        assert "no restart left (2 within the last 300 s, --restart-on-failure 2)" in out
        assert "exited with code 13; shutting down the server" in out
        assert_tree_gone(server)


# ---------------------------------------------------------------- the default path: SmolLM2 in bf16


def smollm2_payloads(tokens: int) -> list[dict[str, Any]]:
    """Eight streams: four greedy, four seeded at temperature 0.7, text prompts of different
    lengths, every one with logprobs (their bits show any difference in arithmetic at once)."""
    topics = [
        "the tides",
        "a lighthouse keeper",
        "bread",
        "the moons of Jupiter",
        "an old map",
        "rain in a city",
        "chess openings",
        "a river delta",
    ]
    out = []
    for i, topic in enumerate(topics):
        params: dict[str, Any] = {"max_new_tokens": tokens, "ignore_eos": True}
        params.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.7, "seed": 1000 + i})
        out.append(
            {
                "text": f"Write a long story about {topic}." + " Be vivid." * (i % 3),
                "sampling_params": params,
                "return_logprob": True,
            }
        )
    return out


INT8 = pytest.mark.skipif(not build.int8_available(), reason="w8a8_int8 needs AMX int8 or AVX-512 VNNI")


# Every case streams 8 x 384 tokens (TP=3, three ranks on two cores and the slow tier's longest case:
# 8 x 256) and is killed 160 tokens in; their logprobs, compared bit for bit, part at the first token
# whose arithmetic differs. int8 at PP=2 is left out: int8 at TP=1 and 3 and bf16 at PP=2 cover its parts.
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    ("flags", "victim"),
    [
        ((), "srt::scheduler_TP0"),
        (("--pp-size", "2"), "srt::scheduler_PP1_TP0"),
        (("--tp", "3"), "srt::scheduler_TP2"),
        (("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "24"), "srt::scheduler_TP0"),
        pytest.param(("--quantization", "w8a8_int8"), "srt::scheduler_TP0", marks=INT8),
        pytest.param(("--quantization", "w8a8_int8", "--tp", "3"), "srt::scheduler_TP1", marks=INT8),
    ],
    ids=["tp1", "pp2", "tp3", "ngram-tp1", "w8a8_int8-tp1", "w8a8_int8-tp3"],
)
def test_smollm2_streams_survive_sigkill_with_their_exact_tokens(flags: tuple[str, ...], victim: str) -> None:
    """The default server (bundled SmolLM2, bf16, the CPU kernels; deterministic inference on by
    itself with --restart-on-failure): a rank SIGKILLed mid-stream in eight streams; every stream's
    ids, text and logprobs equal a fault-free run's on the same server."""
    tokens, killed_at = (256 if "--tp" in flags else 384), 160
    with Server(*flags, "--restart-on-failure", "1", startup_timeout=300) as server:
        bodies = smollm2_payloads(tokens)
        with ThreadPoolExecutor(len(bodies)) as pool:
            expected = [r.json() for r in pool.map(lambda b: server.generate(b, timeout=1200), bodies)]
        assert all(len(e["output_ids"]) == tokens for e in expected), [e.get("error") for e in expected]
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200

        results = streams_through_a_kill(server, bodies, victim, after=killed_at, timeout=1200)
        out = server.output()
        assert "killed by signal SIGKILL; restarting the engine" in out and "engine restarted in" in out
        assert "deterministic inference: every token on the decode kernel's arithmetic" in out
        for i, ((ids, text, logprobs, meta), want) in enumerate(zip(results, expected)):
            parted = next((j for j, (a, b) in enumerate(zip(ids, want["output_ids"])) if a != b), None)
            assert ids == want["output_ids"], f"stream {i} parts from the fault-free tokens at token {parted}"
            assert text == want["text"] and meta["completion_tokens"] == tokens
            assert logprobs == want["meta_info"]["output_token_logprobs"], f"stream {i}'s logprobs"
        assert server.proc.poll() is None
