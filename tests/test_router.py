"""srt behind SGLang's own router (the sglang-router 0.3.2 binary, unmodified): two replicas of a
tiny model with SmolLM2's vocabulary, in float32. Through the router /generate and the OpenAI
routes give what one srt gives directly, streamed or not; cache-aware routing sends a prompt
that shares a cached prefix to the replica that cached it; the router's load view reads
/get_load; losing a replica's scheduler costs only its in-flight requests, which end with an
error, while the router's new requests succeed on the other replica. `launch_server --dp-size 2`
does all of this in one command."""

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
from router_fixture import Router
from server_fixture import Server
from tiny_models import make_tiny_model

from srt.server_process import ROOT, kill_all
from srt.utils import free_port

pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")

LONG_TEXT = " ".join(
    f"Paragraph {i} of the shared context talks about topic {i * 7 % 13}." for i in range(40)
)
MESSAGES = [{"role": "user", "content": "Say something about the weather."}]
DP_KEY = "sk-dp-test-5555"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama_smollm2_vocab", tmp_path_factory.mktemp("router") / "llama")


def replica_args(model_dir: Path, smollm2_dir: Path, *extra: str) -> list[str]:
    return [
        "--model-path",
        str(model_dir),
        "--tokenizer-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "32768",
        *extra,
    ]


@pytest.fixture(scope="module")
def replicas(model_dir: Path, smollm2_dir: Path) -> Iterator[list[Server]]:
    servers = [Server(*replica_args(model_dir, smollm2_dir)) for _ in range(2)]
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def router(replicas: list[Server]) -> Iterator[Router]:
    with Router([s.url for s in replicas]) as router:
        yield router


def greedy(max_new: int = 8) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}


def sse_chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with requests.post(url, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_outputs_through_the_router_equal_one_srt(router: Router, replicas: list[Server]) -> None:
    direct = replicas[0].url
    body = {"text": "The weather today is", "sampling_params": greedy()}
    expected = requests.post(direct + "/generate", json=body, timeout=60).json()
    via = router.post("/generate", body)
    assert via.status_code == 200, via.text
    assert via.json()["output_ids"] == expected["output_ids"] and via.json()["text"] == expected["text"]
    streamed = sse_chunks(router.url + "/generate", {**body, "stream": True})
    assert streamed[-1]["output_ids"] == expected["output_ids"]

    completion = {
        "model": "m",
        "prompt": "The weather today is",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    want = requests.post(direct + "/v1/completions", json=completion, timeout=60).json()["choices"][0]["text"]
    got = router.post("/v1/completions", completion)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want
    chunks = sse_chunks(router.url + "/v1/completions", {**completion, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want

    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = requests.post(direct + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0][
        "message"
    ]
    got = router.post("/v1/chat/completions", chat)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want["content"]
    chunks = sse_chunks(router.url + "/v1/chat/completions", {**chat, "stream": True})
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        == want["content"]
    )


def test_cache_aware_routing_reaches_the_replica_that_cached_the_prefix(
    router: Router, replicas: list[Server]
) -> None:
    for replica in replicas:
        assert requests.post(replica.url + "/flush_cache", timeout=30).status_code == 200
    first = router.post("/generate", {"text": LONG_TEXT + " Question one?", "sampling_params": greedy(2)})
    assert first.status_code == 200 and first.json()["meta_info"]["cached_tokens"] == 0
    second = router.post("/generate", {"text": LONG_TEXT + " Question two?", "sampling_params": greedy(2)})
    assert second.status_code == 200, second.text
    prompt_tokens = second.json()["meta_info"]["prompt_tokens"]
    assert second.json()["meta_info"]["cached_tokens"] > prompt_tokens // 2  # the shared prefix, cached
    chat = router.post(
        "/v1/chat/completions",
        {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": LONG_TEXT + " Question three?"}],
        },
    )
    again = router.post(
        "/v1/chat/completions",
        {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": LONG_TEXT + " Question four?"}],
        },
    )
    assert chat.status_code == again.status_code == 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_router_sees_real_loads_that_rise_under_load(router: Router, replicas: list[Server]) -> None:
    idle = router.loads()
    assert sorted(idle) == sorted(s.url for s in replicas) and all(v >= 0 for v in idle.values()), idle
    stop = threading.Event()

    def busy(i: int) -> None:
        body = {"text": LONG_TEXT + f" Request {i}.", "sampling_params": greedy(400)}
        while not stop.is_set():
            router.post("/generate", body, timeout=300)

    with ThreadPoolExecutor(6) as pool:
        for i in range(6):
            pool.submit(busy, i)
        try:
            deadline, peak = time.monotonic() + 60, 0
            while time.monotonic() < deadline and peak <= 0:
                peak = max(router.loads().values())
                time.sleep(0.2)
            assert peak > 0, router.loads()
        finally:
            stop.set()


def stream_until_done(url: str, body: dict[str, Any]) -> tuple[int, list[str], float]:
    """(status, SSE lines, when it ended: time.monotonic())."""
    try:
        with requests.post(url, json=body, stream=True, timeout=60) as r:
            return (
                r.status_code,
                [line for line in r.iter_lines(decode_unicode=True) if line],
                time.monotonic(),
            )
    except requests.RequestException as error:
        return -1, [repr(error)], time.monotonic()


def scheduler_pid(server: Server) -> int:
    for child in server.children():
        if child.name().startswith("srt::scheduler") or "srt::scheduler" in " ".join(child.cmdline()):
            return child.pid
    raise AssertionError("no scheduler process")


def test_losing_one_replica_costs_only_its_in_flight_requests(model_dir: Path, smollm2_dir: Path) -> None:
    servers = [Server(*replica_args(model_dir, smollm2_dir)) for _ in range(2)]
    try:
        with Router([s.url for s in servers], policy="round_robin") as router:
            body = {"text": "Tell me a long story.", "stream": True, "sampling_params": greedy(3000)}
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(stream_until_done, router.url + "/generate", body) for _ in range(4)]
                deadline = time.monotonic() + 60
                while not all(s.internal_state()["running"] for s in servers):
                    assert time.monotonic() < deadline, "the router did not spread the streams"
                    time.sleep(0.1)
                os.kill(scheduler_pid(servers[1]), signal.SIGKILL)
                killed_at = time.monotonic()
                # new requests all succeed, on the surviving replica
                for i in range(8):
                    r = router.post(
                        "/generate", {"text": f"New request {i}", "sampling_params": greedy(4)}, 60
                    )
                    assert r.status_code == 200, r.text
                for rid in servers[0].internal_state()["running"]:  # end the survivor's long streams
                    requests.post(servers[0].url + "/abort_request", json={"rid": rid}, timeout=10)
                results = [f.result(timeout=60) for f in futures]
            failed = [
                (status, lines, ended)
                for status, lines, ended in results
                if status != 200 or any('"error"' in line for line in lines)
            ]
            assert failed, results  # the dead replica's streams ended with an error ...
            assert all(ended - killed_at < 30 for _, _, ended in failed)  # ... within 30 s: nothing hung
            assert all(lines[-1] == "data: [DONE]" for status, lines, _ in results if status == 200)
            assert servers[1].proc.wait(timeout=30) != 0  # the replica went down loudly
            deadline = time.monotonic() + 10
            while servers[1].url in router.healthy_workers():  # the router's health check saw it
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        for server in servers:
            server.close()


# ---- launch_server --dp-size ----


def titles() -> dict[str, int]:
    found: dict[str, int] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or []).strip()
        if cmd.startswith(("srt::", "sglang::")):
            found[cmd] = proc.info["pid"]
    return found


@pytest.mark.slow  # the default run is at its 20-minute line; the router's own tests stay in it
def test_dp_size_2_one_command(model_dir: Path, smollm2_dir: Path, replicas: list[Server]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"srt-dp-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "srt.launch_server",
                "--dp-size",
                "2",
                "--port",
                str(port),
                "--api-key",
                DP_KEY,
                *replica_args(model_dir, smollm2_dir, "--cpu-kvcache-space", "1"),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    auth = {"Authorization": f"Bearer {DP_KEY}"}
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                workers = requests.get(url + "/workers", headers=auth, timeout=5).json()["workers"]
                if (
                    requests.get(url + "/readiness", timeout=2).ok
                    and len([w for w in workers if w["is_healthy"]]) == 2
                ):
                    break
            except (requests.RequestException, ValueError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        mine = {
            t: pid
            for t, pid in titles().items()
            if psutil.Process(pid).ppid() != 1 and _descends(pid, proc.pid)
        }
        assert {
            "srt::scheduler_DP0_TP0",
            "srt::scheduler_DP1_TP0",
            "srt::detokenizer_DP0",
            "srt::detokenizer_DP1",
            "sglang::router",
        } <= set(mine), mine
        body = {"text": "The weather today is", "sampling_params": greedy()}
        expected = requests.post(replicas[0].url + "/generate", json=body, timeout=60).json()["output_ids"]
        assert (
            requests.post(url + "/generate", json=body, timeout=60).status_code == 401
        )  # the key reached the router
        assert (
            requests.post(url + "/generate", json=body, headers=auth, timeout=60).json()["output_ids"]
            == expected
        )
        replica_cmds = [
            " ".join(c.cmdline())
            for c in psutil.Process(proc.pid).children()
            if "srt.launch_server" in " ".join(c.cmdline())
        ]
        assert len(replica_cmds) == 2 and not any(
            DP_KEY in c for c in replica_cmds
        )  # the key goes by environment
        assert all("--cpu-kvcache-space 0.5" in c for c in replica_cmds), (
            replica_cmds
        )  # the host's KV space, split
        # a lost replica is named and started again; the other serves meanwhile
        os.kill(mine["srt::scheduler_DP1_TP0"], signal.SIGKILL)
        for _ in range(4):
            assert requests.post(url + "/generate", json=body, headers=auth, timeout=60).status_code == 200
        deadline = time.monotonic() + 180
        while "replica DP1" not in log.read_text() or "starting it again" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(1)
        assert not [
            pid
            for pid in mine.values()
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
        ]
    finally:
        if proc.poll() is None:
            kill_all([psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)])


def _descends(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def test_dp_size_needs_the_router_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from launcher import data_parallel

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r'pip install -e "\.\[router\]"'):
        data_parallel.require_router()


def test_split_cpus_divides_the_cores() -> None:
    from launcher.data_parallel import split_cpus

    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([3], 2) == [[3], [3]]  # fewer cores than replicas: they share
