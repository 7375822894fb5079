"""Fail loudly, never hang: rank deaths, start-up crashes, exceptions, stalls and divergence on a
real TP=2 server (tiny model). Every scenario has a time bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from server_fixture import Server

from srt.server_process import ROOT
from srt.utils import free_port

LONG = {
    "input_ids": list(range(5, 25)),
    "sampling_params": {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True},
}


def server_args(long_context_llama: Path, smollm2_dir: Path, *extra: str) -> list[str]:
    return [
        "--model-path",
        str(long_context_llama),
        "--tokenizer-path",
        str(smollm2_dir),
        "--tp",
        "2",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        *extra,
    ]


def rank_pid(server: Server, title: str) -> int:
    for p in server.children():
        if " ".join(p.cmdline()).strip() == title:
            return p.pid
    raise AssertionError(f"no process titled {title}")


def stream_until_end(server: Server, payload: dict[str, Any]) -> tuple[int, list[str]]:
    """Returns (status, SSE data lines); must end within the request timeout."""
    with requests.post(
        server.url + "/generate", json={**payload, "stream": True}, stream=True, timeout=30
    ) as r:
        return r.status_code, [ln for ln in r.iter_lines(decode_unicode=True) if ln]


def wait_exit(server: Server, timeout: float) -> int:
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"server still running after {timeout} s:\n{server.output()[-3000:]}") from None


_DESCENDANTS: dict[int, list[psutil.Process]] = {}


def remember_tree(server: Server) -> None:
    _DESCENDANTS[server.proc.pid] = server.children()


def assert_tree_gone(server: Server, timeout: float = 10.0) -> None:
    procs = _DESCENDANTS.get(server.proc.pid, [])
    assert procs, "remember_tree was not called"
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, [p.pid for p in alive]


def under_streaming_load(server: Server, n: int = 4) -> Iterator[Any]:
    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(stream_until_end, server, LONG) for _ in range(n)]
    time.sleep(1.5)  # all streams are mid-generation
    yield futures
    pool.shutdown(wait=False)


# TP0 (the rank that reads the socket) is the slow tier's: the default run keeps one victim.
@pytest.mark.parametrize(
    "victim", ["srt::scheduler_TP1", pytest.param("srt::scheduler_TP0", marks=pytest.mark.slow)]
)
def test_sigkill_a_rank_under_streaming_load(
    long_context_llama: Path, smollm2_dir: Path, victim: str
) -> None:
    with Server(*server_args(long_context_llama, smollm2_dir)) as server:
        remember_tree(server)
        for futures in under_streaming_load(server):
            os.kill(rank_pid(server, victim), signal.SIGKILL)
            start = time.monotonic()
            for f in futures:
                status, lines = f.result(timeout=20)
                assert status == 200 and lines[-1] == "data: [DONE]"
                assert any("error" in json.loads(ln[6:]) for ln in lines[:-1]), lines[-3:]
            assert time.monotonic() - start < 20
        code = wait_exit(server, 20)
        assert code != 0
        assert f"scheduler {victim.split('_')[-1]} (pid" in server.output()
        assert "killed by signal SIGKILL" in server.output()
        assert_tree_gone(server)


def test_sigkill_main_process_takes_children_down(long_context_llama: Path, smollm2_dir: Path) -> None:
    with Server(*server_args(long_context_llama, smollm2_dir)) as server:
        children = server.children()
        assert len(children) >= 3
        os.kill(server.proc.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.pid for p in alive]


def launch_expect_failure(
    args: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "srt.launch_server", "--port", str(free_port()), *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_crash_during_startup_is_a_clear_error(long_context_llama: Path, smollm2_dir: Path) -> None:
    start = time.monotonic()
    done = launch_expect_failure(
        server_args(long_context_llama, smollm2_dir), {"SRT_TEST_FAULT": "crash@1:0"}, 60
    )
    assert done.returncode != 0
    assert "scheduler TP1" in done.stderr and "exited with code 13" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 30  # start-up itself takes most of this on 2 busy cores


@pytest.mark.parametrize("fault", ["raise@1:5", pytest.param("raise@0:5", marks=pytest.mark.slow)])
def test_exception_on_a_rank_takes_the_server_down(
    long_context_llama: Path, smollm2_dir: Path, fault: str
) -> None:
    with Server(*server_args(long_context_llama, smollm2_dir), env={"SRT_TEST_FAULT": fault}) as server:
        remember_tree(server)
        r = server.generate(LONG, timeout=20)
        assert r.status_code == 503 and "error" in r.json(), r.text
        assert wait_exit(server, 20) != 0
        out = server.output()
        assert "fault injection: raise on rank" in out and "Traceback" in out
        assert_tree_gone(server)


def test_soft_watchdog_dumps_both_ranks_and_keeps_serving(
    long_context_llama: Path, smollm2_dir: Path
) -> None:
    with Server(
        *server_args(long_context_llama, smollm2_dir, "--soft-watchdog-timeout", "2"),
        env={"SRT_TEST_FAULT": "stall@1:3"},
    ) as server:
        # The stalled request never answers: a daemon thread holds it, so the test does not wait out
        # its timeout (the server's exit ends it).
        threading.Thread(
            target=lambda: requests.post(server.url + "/generate", json=LONG, timeout=60), daemon=True
        ).start()
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            out = server.output()
            if (
                "scheduler_TP0] ERROR" in out
                and "scheduler_TP1] ERROR" in out
                and out.count("soft watchdog") >= 2
            ):
                break
            time.sleep(0.5)
        out = server.output()
        assert "soft watchdog timeout" in out, out[-3000:]
        assert out.count("soft watchdog timeout") >= 2  # both ranks stopped making progress and dumped
        assert "Thread" in out or "thread" in out  # the stacks are in the dump
        assert server.proc.poll() is None
        assert requests.get(server.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("py_spy", ["py-spy", pytest.param("/nonexistent/py-spy", marks=pytest.mark.slow)])
def test_hard_watchdog_takes_the_server_down(
    long_context_llama: Path, smollm2_dir: Path, py_spy: str
) -> None:
    with Server(
        *server_args(long_context_llama, smollm2_dir, "--watchdog-timeout", "3"),
        env={"SRT_TEST_FAULT": "stall@1:3", "SRT_PY_SPY": py_spy},
    ) as server:
        remember_tree(server)
        r = server.generate(LONG, timeout=30)
        assert r.status_code == 503
        assert wait_exit(server, 30) != 0
        out = server.output()
        assert "watchdog timeout" in out and "hard watchdog fired" in out
        assert ("py-spy dump" in out) == (py_spy == "py-spy")
        assert "faulthandler dump" in out or py_spy == "py-spy"
        assert_tree_gone(server)


def run_diverged(server: Server) -> tuple[list[requests.Response], str]:
    """Four prompts into a server whose rank 1 admits one fewer: every request ends (200 or 503)
    and the server exits non-zero within 30 s, leaving no process behind. -> (responses, log)."""
    remember_tree(server)
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda i: server.generate(
                    {**LONG, "input_ids": LONG["input_ids"][i:]},  # type: ignore[index]
                    timeout=30,
                ),
                range(4),
            )
        )
    assert all(r.status_code in (200, 503) for r in results)
    assert wait_exit(server, 30) != 0
    assert time.monotonic() - start < 30
    assert_tree_gone(server)
    return results, server.output()


def test_diverge_batch_is_caught_by_the_consensus_checker(
    long_context_llama: Path, smollm2_dir: Path
) -> None:
    with Server(
        *server_args(long_context_llama, smollm2_dir, "--enable-rank-consensus-checker"),
        env={"SRT_TEST_FAULT": "diverge_batch@1:1"},
    ) as server:
        results, out = run_diverged(server)
        assert any(
            r.status_code == 503 or r.json()["meta_info"]["finish_reason"]["type"] == "abort" for r in results
        )
        for rank in ("scheduler_TP0", "scheduler_TP1"):
            assert any("divergence" in line and rank in line for line in out.splitlines()), out[-4000:]


def test_diverging_pipeline_stages_stop_at_the_stage_gate(
    long_context_llama: Path, smollm2_dir: Path
) -> None:
    """PP=2: stage 1 schedules one request fewer. Without the stage gate the stages exchanged
    hidden states of different shapes and gloo killed stage 0 with SIGABRT, naming nothing."""
    args = server_args(
        long_context_llama, smollm2_dir, "--enable-rank-consensus-checker", "--tp", "1", "--pp-size", "2"
    )
    with Server(*args, env={"SRT_TEST_FAULT": "diverge_batch@1:1"}) as server:
        _, out = run_diverged(server)
        assert "pipeline stages scheduled different batches at forward step 1: stage 0 extend of" in out, out[
            -4000:
        ]
        assert "SIGABRT" not in out


def greedy_outputs(server: Server, n: int = 4) -> list[list[int]]:
    payloads = [
        {
            "input_ids": list(range(7 + i, 30 + 2 * i)),
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        }
        for i in range(n)
    ]
    with ThreadPoolExecutor(n) as pool:
        return [r.json()["output_ids"] for r in pool.map(server.generate, payloads)]


def test_token_sync_repairs_a_diverging_token(long_context_llama: Path, smollm2_dir: Path) -> None:
    with Server(*server_args(long_context_llama, smollm2_dir)) as server:
        expected = greedy_outputs(server)
    with Server(
        *server_args(long_context_llama, smollm2_dir, "--sync-token-ids-across-tp"),
        env={"SRT_TEST_FAULT": "diverge_token@1:2"},
    ) as server:
        assert greedy_outputs(server) == expected
