"""What stands before a route (srt/guard.py) and what refuses work the server cannot queue:
--api-key / --admin-api-key on every route but the probes (401 without or with a wrong key, 200 with
the right one; the official openai client; the key never in the log or /server_info; through
sglang-router, which takes the key from clients and gives it to the workers), --max-request-bytes
(413), --max-queued-requests (a burst gets some 503 with Retry-After at once, the rest
complete with the outputs they would have had, at TP=2 with the KV cache intact), and request
deadlines (aborted by the front end on every rank at once)."""

from __future__ import annotations

import http.client
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from server_fixture import Server
from tiny_models import make_tiny_model

from srt.guard import auth_refusal

KEY, ADMIN = "sk-test-0123456789", "admin-test-9876543210"
PROMPT = [(5 * i + 11) % 300 + 10 for i in range(12)]


def test_auth_decisions() -> None:
    assert auth_refusal("/generate", "POST", None, None, None) is None  # no keys: open
    assert auth_refusal("/generate", "POST", None, KEY, None) is not None
    assert auth_refusal("/generate", "POST", "Bearer nope", KEY, None) is not None
    assert auth_refusal("/generate", "POST", f"Bearer {KEY}", KEY, None) is None
    assert auth_refusal("/generate", "POST", f"bearer {KEY}", KEY, None) is None
    assert auth_refusal("/generate", "POST", KEY, KEY, None) is not None  # no scheme
    for probe in ("/health", "/health_generate", "/metrics", "/ready"):
        assert auth_refusal(probe, "GET", None, KEY, ADMIN) is None
    assert auth_refusal("/flush_cache", "POST", f"Bearer {KEY}", KEY, ADMIN) is not None  # admin route
    assert auth_refusal("/flush_cache", "POST", f"Bearer {ADMIN}", KEY, ADMIN) is None
    assert (
        auth_refusal("/flush_cache", "POST", f"Bearer {KEY}", KEY, None) is None
    )  # no admin key: the key opens it
    assert auth_refusal("/generate", "POST", f"Bearer {ADMIN}", KEY, ADMIN) is not None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Server]:
    model = make_tiny_model(
        "llama_smollm2_vocab", tmp_path_factory.mktemp("guard") / "llama"
    )  # chat templates fit
    with Server(
        "--model-path",
        str(model),
        "--tokenizer-path",
        str(smollm2_dir),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        "--api-key",
        KEY,
        "--admin-api-key",
        ADMIN,
        "--max-request-bytes",
        "4000",
        "--enable-metrics",
    ) as server:
        yield server


ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    ("GET", "/v1/models", None),
    ("GET", "/model_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/server_info", None),
    ("GET", "/get_load", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/abort_request", {"rid": "nobody"}),
]


def call(
    server: Server, method: str, path: str, body: dict[str, Any] | None, key: str | None
) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_each_route_needs_the_key(
    server: Server, method: str, path: str, body: dict[str, Any] | None
) -> None:
    for key in (None, "wrong-key"):
        r = call(server, method, path, body, key)
        assert r.status_code == 401, (key, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert KEY not in r.text
    r = call(server, method, path, body, KEY)
    assert r.status_code == 200, r.text


def test_admin_route_probes_and_secrets(server: Server) -> None:
    assert (
        call(server, "POST", "/flush_cache", None, KEY).status_code == 401
    )  # the normal key does not open it
    assert call(server, "POST", "/flush_cache", None, ADMIN).status_code == 200
    for probe in ("/health", "/metrics"):
        assert requests.get(server.url + probe, timeout=30).status_code == 200
    info = call(server, "GET", "/server_info", None, KEY).json()
    assert info["api_key"] == "<set>" and info["admin_api_key"] == "<set>"
    assert KEY not in server.output() and ADMIN not in server.output()


def test_the_openai_client_with_its_api_key(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_body_over_the_cap_is_a_413(server: Server) -> None:
    big = {"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 1}}
    r = call(server, "POST", "/generate", big, KEY)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    # without a Content-Length (chunked): refused once the body passes the cap
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/generate")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    payload = b'{"input_ids": [' + b"5, " * 2000 + b"5]}"
    for start in range(0, len(payload), 1000):
        chunk = payload[start : start + 1000]
        conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    conn.send(b"0\r\n\r\n")
    assert conn.getresponse().status == 413
    conn.close()
    assert (
        call(
            server, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}, KEY
        ).status_code
        == 200
    )


def test_the_router_takes_the_key_from_clients_and_gives_it_to_workers(server: Server) -> None:
    pytest.importorskip("sglang_router", reason="the test extra installs sglang-router")
    from router_fixture import Router

    with Router([server.url], api_key=KEY) as router:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert requests.post(router.url + "/generate", json=body, timeout=60).status_code == 401
        via = requests.post(router.url + "/generate", json=body, headers=router.headers, timeout=60)
        assert via.status_code == 200, via.text
        assert via.json()["output_ids"] == call(server, "POST", "/generate", body, KEY).json()["output_ids"]


@pytest.mark.slow  # two TP=2 servers, about 40 s: keeps the default tier under 20 minutes
def test_a_burst_past_max_queued_requests(tiny_model_dirs: dict[str, Path], smollm2_dir: Path) -> None:
    prompts = [[(7 * i + j) % 300 + 10 for j in range(10)] for i in range(32)]

    def greedy(ids: list[int]) -> dict[str, Any]:
        return {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        }

    common = (
        "--model-path",
        str(tiny_model_dirs["llama"]),
        "--tokenizer-path",
        str(smollm2_dir),
        "--tp",
        "2",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "2",
    )
    with Server(*common) as reference:
        expected = [reference.generate(greedy(ids)).json()["output_ids"] for ids in prompts[:4]]
    with Server(*common, "--max-queued-requests", "4", "--enable-rank-consensus-checker") as server:
        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda ids: server.generate(greedy(ids)), prompts))
        busy = [r for r in replies if r.status_code == 503]
        done = [(i, r) for i, r in enumerate(replies) if r.status_code == 200]
        assert busy and done and len(busy) + len(done) == 32, [r.status_code for r in replies]
        assert all(
            r.headers["Retry-After"] == "1" and "--max-queued-requests 4" in r.json()["error"]["message"]
            for r in busy
        )
        for i, r in done:  # each completed request has what it has alone
            assert len(r.json()["output_ids"]) == 24
            if i < 4:
                assert r.json()["output_ids"] == expected[i]
        state = server.internal_state()
        assert state["kv_integrity_error"] is None and not state["running"] and not state["waiting"]
        assert "divergence" not in server.output()
        assert [server.generate(greedy(ids)).json()["output_ids"] for ids in prompts[:4]] == expected


def test_deadlines_abort_on_every_rank(long_context_llama: Path, smollm2_dir: Path) -> None:
    """SGLang's waiting and running timeouts, decided by the front end and broadcast as aborts: at
    TP=2 with the consensus checker, a request still generating past --req-running-timeout and one
    still waiting past --req-waiting-timeout both end with 503 and SGLang's messages, both ranks
    abort them, and the server goes on with its KV cache intact."""

    def body(ids: list[int], tokens: int, stream: bool = False) -> dict[str, Any]:
        return {
            "input_ids": ids,
            "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        }

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
        "16384",
        "--max-running-requests",
        "1",
        "--req-waiting-timeout",
        "1",
        "--req-running-timeout",
        "2",
        "--enable-rank-consensus-checker",
    ) as server:
        expected = server.generate(body(PROMPT, 8)).json()["output_ids"]
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(server.generate, {**body(PROMPT, 8000), "rid": "long-one"})
            time.sleep(0.3)  # queued behind it: --max-running-requests 1
            queued = pool.submit(server.generate, {**body(PROMPT[:6], 8), "rid": "queued-one"})
            running, waiting = long.result(timeout=60), queued.result(timeout=60)
        assert (
            running.status_code == 503
            and running.json()["error"]["message"] == "Request running timeout reached."
        )
        assert (
            waiting.status_code == 503
            and waiting.json()["error"]["message"] == "Request waiting timeout reached."
        )
        out = server.output()
        for rank in ("scheduler_TP0", "scheduler_TP1"):
            for rid, reason in (("long-one", "running"), ("queued-one", "waiting")):
                assert re.search(
                    rf"{rank}\] INFO srt.scheduler: aborted {rid}: Request {reason} timeout", out
                ), (rank, rid, out[-3000:])
        state = server.internal_state()
        assert state["kv_integrity_error"] is None and not state["running"] and not state["waiting"]
        assert "divergence" not in server.output()
        assert server.generate(body(PROMPT, 8)).json()["output_ids"] == expected  # it serves on
