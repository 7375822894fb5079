"""SIGTERM on the real process tree: new requests get 503 at once, the ones in flight finish (or,
past --shutdown-timeout or on a second signal, get a 503), then the server exits 0 and leaves no
process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from server_fixture import Server

from srt.server_process import ROOT
from srt.utils import free_port

MAX_NEW = 300  # long enough that the drain outlasts the probe for a 503 (the tiny model allows 512 positions)
SHUTTING_DOWN_BODY = {
    "error": {"message": "server is shutting down", "type": "ServiceUnavailable", "code": 503}
}


def payload(ids: list[int], max_new: int, stream: bool = False) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "stream": stream,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }


def server_args(model_dir: Path, tokenizer_dir: Path, *extra: str) -> list[str]:
    return [
        "--model-path",
        str(model_dir),
        "--tokenizer-path",
        str(tokenizer_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "16384",
        *extra,
    ]


class StreamClient(threading.Thread):
    """Reads one SSE /generate to the end; `first_chunk` is set once generation is under way."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first_chunk = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with requests.post(self.url + "/generate", json=self.body, stream=True, timeout=60) as r:
                self.status = r.status_code
                for raw in r.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if line:
                        self.lines.append(line)
                        self.first_chunk.set()
        except Exception as error:  # reported by the test's assertions
            self.error = error
        finally:
            self.first_chunk.set()

    def chunks(self) -> list[dict[str, Any]]:
        assert self.error is None and self.status == 200, (self.error, self.status, self.lines)
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]


class PostClient(threading.Thread):
    """One non-streaming /generate; records the response and when it arrived."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: requests.Response | None = None
        self.error: Exception | None = None
        self.finished_at = 0.0

    def run(self) -> None:
        try:
            self.response = requests.post(self.url + "/generate", json=self.body, timeout=60)
        except Exception as error:  # reported by the test's assertions
            self.error = error
        self.finished_at = time.monotonic()

    def result(self) -> requests.Response:
        assert self.error is None and self.response is not None, self.error
        return self.response


def descendants(server: Server) -> list[psutil.Process]:
    procs = server.children()
    assert procs, "the server has no children"
    return procs


def assert_all_gone(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            assert proc.status() == psutil.STATUS_ZOMBIE, f"{proc.pid} ({proc.name()}) outlived the server"
        except psutil.NoSuchProcess:
            pass


def probe_until_refused(server: Server, budget_s: float = 2.0) -> list[requests.Response]:
    """New requests right after the signal: 200 until the server sees it, then 503 (or, once it has
    closed its listener, a connection error). Returns the 503 responses seen (/generate, /health)."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        try:
            r = server.generate(payload([5, 6, 7], 2), timeout=10)
        except requests.ConnectionError:
            return []
        if r.status_code == 503:
            refused = [r]
            try:
                refused.append(requests.get(server.url + "/health", timeout=10))
            except requests.ConnectionError:
                pass
            return refused
        assert r.status_code == 200, r.text
        time.sleep(0.02)
    return []


def test_sigterm_lets_in_flight_requests_finish(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    prompts = [[3 + 7 * i + k for k in range(12)] for i in range(4)]
    with Server(*server_args(tiny_model_dirs["llama"], smollm2_dir)) as server:
        procs = descendants(server)
        posts = [PostClient(server.url, payload(ids, MAX_NEW)) for ids in prompts[:3]]
        for post in posts:
            post.start()
        stream = StreamClient(server.url, payload(prompts[3], MAX_NEW, stream=True))
        stream.start()
        assert stream.first_chunk.wait(30)
        signalled_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        refused = probe_until_refused(server)
        for thread in (*posts, stream):
            thread.join(30)
        code = server.proc.wait(timeout=20)
        assert code == 0, server.output()[-3000:]

        assert refused, "no request was refused with 503 after SIGTERM"
        for r in refused:
            assert r.status_code == 503 and r.json() == SHUTTING_DOWN_BODY, (r.status_code, r.text)
        for post in posts:
            r = post.result()
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["meta_info"]["finish_reason"]["type"] == "length"
            assert len(body["output_ids"]) == body["meta_info"]["completion_tokens"] == MAX_NEW
            assert post.finished_at > signalled_at  # it really was in flight when the signal came
        last = stream.chunks()[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert len(last["output_ids"]) == MAX_NEW
        assert_all_gone(procs)


@pytest.mark.parametrize(
    ("extra_args", "signals", "reason"),
    [
        (["--shutdown-timeout", "1"], [signal.SIGTERM], "--shutdown-timeout (1 s)"),
        pytest.param([], [signal.SIGINT, signal.SIGINT], "a second shutdown signal", marks=pytest.mark.slow),
    ],
    ids=["timeout", "second_signal"],
)
def test_requests_still_running_get_503(
    long_context_llama: Path,
    smollm2_dir: Path,
    extra_args: list[str],
    signals: list[signal.Signals],
    reason: str,
) -> None:
    with Server(*server_args(long_context_llama, smollm2_dir, *extra_args)) as server:
        procs = descendants(server)
        post = PostClient(server.url, payload([5, 6, 7], 5000))
        post.start()
        stream = StreamClient(server.url, payload([8, 9, 10], 5000, stream=True))
        stream.start()
        assert stream.first_chunk.wait(30)
        deadline = time.monotonic() + 10
        while len(server.internal_state()["running"]) < 2:
            assert time.monotonic() < deadline, "the long requests did not start"
            time.sleep(0.05)
        for sig in signals:
            server.proc.send_signal(sig)
            time.sleep(0.5)
        post.join(20)
        stream.join(20)
        code = server.proc.wait(timeout=10)
        assert code == 0, server.output()[-3000:]

        r = post.result()
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "ServiceUnavailable" and error["code"] == 503
        assert error["message"].startswith("server is shutting down: ") and reason in error["message"]
        last = stream.chunks()[-1]
        assert last["error"]["code"] == 503 and reason in last["error"]["message"]
        assert_all_gone(procs)


def test_sigterm_while_starting_up_exits_0(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "srt.launch_server",
            "--port",
            str(port),
            *server_args(tiny_model_dirs["llama"], smollm2_dir),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while len(procs) < 2:  # the scheduler and the detokenizer, before the HTTP server is up
            assert proc.poll() is None and time.monotonic() < deadline, "the children did not start"
            procs = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.05)
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err[-3000:]
        assert "received SIGTERM; shutting down" in err
        assert_all_gone(procs)
    finally:
        for p in [*procs, psutil.Process(proc.pid)] if proc.poll() is None else procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=10)
