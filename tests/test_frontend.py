"""HTTP layer + TokenizerManager against a fake scheduler/detokenizer (no model, no ranks).

The fake PULLs what rank 0 would get and answers each request with the last three prompt ids,
one token per message, through the real DetokenizerManager. Rids starting with "hold-" get no
output until aborted (then they finish with reason "abort").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import uvicorn
import uvloop
import zmq
from fastapi import FastAPI
from transformers import AutoTokenizer
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from srt.detokenizer import DetokenizerManager
from srt.http_common import sse
from srt.http_server import create_app, uvicorn_config
from srt.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReply,
    DecodeSpec,
    FinishReason,
    FlushCacheReq,
    GetInternalStateReq,
    TokenizedGenerateReq,
    TokenLogprobs,
)
from srt.logprob_meta import LogprobMeta
from srt.request_state import ReqState
from srt.server_args import PortArgs, ServerArgs
from srt.tokenizer_manager import ServiceUnavailableError, TokenizerManager

CONTEXT_LENGTH = 256
VOCAB_SIZE = 49152


class FakeBackend(threading.Thread):
    def __init__(self, port_args: PortArgs, tokenizer: Any) -> None:
        super().__init__(daemon=True)
        self.port_args = port_args
        self.detokenizer = DetokenizerManager(tokenizer)
        self.received: list[Any] = []
        self.sent_lists: list[list[Any]] = []  # the batches that came as one message, as sent
        self.held: dict[str, TokenizedGenerateReq] = {}
        self.answer_control = True
        self.stopping = threading.Event()

    def run(self) -> None:
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.bind(self.port_args.tokenizer_ipc)
        push = context.socket(zmq.PUSH)
        push.connect(self.port_args.tokenizer_manager_ipc)
        while not self.stopping.is_set():
            if pull.poll(20):
                message = pull.recv_pyobj()
                if isinstance(message, list):  # a batch in one message, as scheduler/receiver.py takes it
                    self.sent_lists.append(message)
                for msg in message if isinstance(message, list) else [message]:
                    self.handle(msg, push)
        context.destroy(linger=0)

    def handle(self, msg: Any, push: zmq.Socket) -> None:
        self.received.append(msg)
        if isinstance(msg, TokenizedGenerateReq):
            if msg.rid.startswith("hold-"):
                self.held[msg.rid] = msg
                return
            output = (msg.input_ids * 3)[-3:][: max(1, msg.sampling_params.max_new_tokens)]
            for k, token in enumerate(output):
                finished = FinishReason("length") if k == len(output) - 1 else None
                self.send_tokens(push, msg, [token], finished, k + 1)
        elif isinstance(msg, AbortReq) and msg.rid in self.held:
            req = self.held.pop(msg.rid)
            self.send_tokens(push, req, [], FinishReason("abort", message=msg.reason), 0)
        elif isinstance(msg, (FlushCacheReq, GetInternalStateReq)) and self.answer_control:
            payload = {"fake_state": 1} if isinstance(msg, GetInternalStateReq) else {}
            push.send_pyobj(ControlReply(msg.request_id, True, payload))

    def send_tokens(
        self,
        push: zmq.Socket,
        req: TokenizedGenerateReq,
        ids: list[int],
        finished: FinishReason | None,
        done: int,
    ) -> None:
        out = BatchTokenIDOut(
            [req.rid],
            [ids],
            [finished],
            [len(req.input_ids)],
            [done],
            [0],
            [DecodeSpec.of(req.sampling_params)],
        )
        push.send_pyobj(self.detokenizer.handle_batch_token_id_out(out))

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in list(self.received) if predicate(m)]
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError("the fake backend never received the expected message")


class Server:
    def __init__(
        self, tmp_path: Path, tokenizer_dir: Path, tokenizer: Any, server_args: ServerArgs | None = None
    ) -> None:
        self.port_args = PortArgs(
            tokenizer_ipc=f"ipc://{tmp_path}/t",
            detokenizer_ipc=f"ipc://{tmp_path}/d",
            tokenizer_manager_ipc=f"ipc://{tmp_path}/tm",
            dist_init_method="tcp://127.0.0.1:1",
        )
        model_info = {
            "context_length": CONTEXT_LENGTH,
            "vocab_size": VOCAB_SIZE,
            "max_total_tokens": 1000,
            "eos_token_ids": [2],
            "model_path": "/models/fake",
        }
        self.tm = TokenizerManager(
            server_args or ServerArgs(random_seed=7), self.port_args, str(tokenizer_dir), model_info
        )
        self.backend = FakeBackend(self.port_args, tokenizer)
        self.backend.start()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(self.tm, {"tp_size": 1, "model_path": "/models/fake"})
        self.uvicorn = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def post(
        self, path: str, body: Any = None, data: bytes | None = None, **kwargs: Any
    ) -> requests.Response:
        if data is None:
            data = json.dumps(body).encode()
        return requests.post(
            self.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30, **kwargs
        )

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.backend.stopping.set()
        self.backend.join(10)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, tokenizer: Any) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("ipc"), smollm2_dir, tokenizer)
    yield srv
    srv.close()


@pytest.fixture
def fresh_server(tmp_path: Path, smollm2_dir: Path, tokenizer: Any) -> Iterator[Server]:
    srv = Server(tmp_path, smollm2_dir, tokenizer)
    yield srv
    srv.close()


def assert_good_generation(server: Server, tokenizer: Any) -> None:
    resp = server.post("/generate", {"text": "Hello big world", "rid": None})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ids = tokenizer("Hello big world")["input_ids"]
    assert out["output_ids"] == ids[-3:]
    assert out["text"] == tokenizer.decode(ids[-3:], skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 3 and meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length"} and meta["e2e_latency"] > 0 and meta["id"]


TOO_LONG = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": CONTEXT_LENGTH - 9}}
BAD_REQUESTS: list[tuple[str, Any, str | None, str]] = [
    # (case, body: object or raw bytes, expected param, text the message must contain)
    ("malformed json", b'{"text": "hi"', None, "JSON"),
    ("empty body", b"", None, "JSON"),
    ("non-object body", [1, 2], None, "object"),
    ("string body", "hi", None, "object"),
    ("invalid utf-8", b'{"text": "\xff\xfe"}', None, "UTF-8"),
    ("no prompt", {"sampling_params": {}}, "text", "text or input_ids"),
    ("empty text", {"text": ""}, "text", "empty"),
    ("empty input_ids", {"input_ids": []}, "input_ids", "input_ids"),
    ("empty batch row ids", {"input_ids": [[1, 2], []]}, "input_ids", "input_ids[1]"),
    ("empty batch row text", {"text": ["a", ""]}, "text", "text[1]"),
    ("empty batch", {"text": []}, "text", "text"),
    ("both prompts", {"text": "a", "input_ids": [1]}, "input_ids", "not both"),
    ("id over vocab", {"input_ids": [1, VOCAB_SIZE]}, "input_ids", str(VOCAB_SIZE)),
    ("negative id", {"input_ids": [-1]}, "input_ids", "-1"),
    ("float id", {"input_ids": [1.5]}, "input_ids", "1.5"),
    ("bool id", {"input_ids": [True]}, "input_ids", "True"),
    ("context overflow", TOO_LONG, "max_new_tokens", f"({CONTEXT_LENGTH - 9})"),
    (
        "max_new_tokens float",
        {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}},
        "max_new_tokens",
        "1.5",
    ),
    (
        "max_new_tokens negative",
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        "max_new_tokens",
        "-1",
    ),
    (
        "max_new_tokens string",
        {"text": "hi", "sampling_params": {"max_new_tokens": "3"}},
        "max_new_tokens",
        "3",
    ),
    ("temperature negative", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature", "-0.5"),
    (
        "temperature NaN number",
        b'{"text": "hi", "sampling_params": {"temperature": NaN}}',
        "temperature",
        "nan",
    ),
    (
        "temperature NaN string",
        {"text": "hi", "sampling_params": {"temperature": "NaN"}},
        "temperature",
        "NaN",
    ),
    (
        "temperature inf",
        b'{"text": "hi", "sampling_params": {"temperature": Infinity}}',
        "temperature",
        "inf",
    ),
    ("temperature 1e999", b'{"text": "hi", "sampling_params": {"temperature": 1e999}}', "temperature", "inf"),
    (
        "temperature huge int",
        {"text": "hi", "sampling_params": {"temperature": 10**400}},
        "temperature",
        "range",
    ),
    ("top_p zero", {"text": "hi", "sampling_params": {"top_p": 0}}, "top_p", "(0, 1]"),
    ("top_p over one", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p", "1.5"),
    ("top_p NaN", b'{"text": "hi", "sampling_params": {"top_p": NaN}}', "top_p", "nan"),
    ("top_k zero", {"text": "hi", "sampling_params": {"top_k": 0}}, "top_k", "0"),
    ("top_k below -1", {"text": "hi", "sampling_params": {"top_k": -2}}, "top_k", "-2"),
    ("min_p negative", {"text": "hi", "sampling_params": {"min_p": -0.1}}, "min_p", "[0, 1]"),
    ("min_p over one", {"text": "hi", "sampling_params": {"min_p": 1.1}}, "min_p", "1.1"),
    ("empty stop string", {"text": "hi", "sampling_params": {"stop": ""}}, "stop", "empty"),
    ("empty stop in list", {"text": "hi", "sampling_params": {"stop": ["a", ""]}}, "stop", "empty"),
    (
        "null stop_token_id",
        {"text": "hi", "sampling_params": {"stop_token_ids": [None]}},
        "stop_token_ids",
        "None",
    ),
    (
        "stop_token_id over vocab",
        {"text": "hi", "sampling_params": {"stop_token_ids": [VOCAB_SIZE]}},
        "stop_token_ids",
        str(VOCAB_SIZE),
    ),
    ("unknown sampling param", {"text": "hi", "sampling_params": {"temprature": 1}}, "temprature", "unknown"),
    ("unknown field", {"text": "hi", "return_hiden_states": False}, "return_hiden_states", "unknown"),
    (
        "unsupported field",
        {"text": "hi", "return_hidden_states": True},
        "return_hidden_states",
        "not supported",
    ),
    (
        "unsupported sampling param",
        {"text": "hi", "sampling_params": {"beam_width": 4}},
        "beam_width",
        "not supported",
    ),
    (
        "bad stop_regex",
        {"text": "hi", "sampling_params": {"stop_regex": "a("}},
        "stop_regex",
        "regular expression",
    ),
    (
        "logit_bias key",
        {"text": "hi", "sampling_params": {"logit_bias": {"x": 1}}},
        "logit_bias",
        "token ids",
    ),
    ("logit_bias value", {"text": "hi", "sampling_params": {"logit_bias": {"1": 101}}}, "logit_bias", "101"),
    ("n zero", {"text": "hi", "sampling_params": {"n": 0}}, "n", "[1, 128]"),
    ("n differs in batch", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "n", "same"),
    (
        "seeds differ",
        {"text": "hi", "sampling_params": {"seed": 1, "sampling_seed": 2}},
        "sampling_seed",
        "differ",
    ),
    ("priority without the flag", {"text": "hi", "priority": 3}, "priority", "--enable-priority-scheduling"),
    ("log_metrics not bool", {"text": "hi", "log_metrics": 1}, "log_metrics", "boolean"),
    ("stream not bool", {"text": "hi", "stream": "yes"}, "stream", "stream"),
    ("rid not string", {"text": "hi", "rid": 5}, "rid", "rid"),
    ("batch rid count", {"text": ["a", "b"], "rid": ["x"]}, "rid", "rid"),
    ("lone surrogate", b'{"text": "a\\ud800b"}', "text", "surrogate"),
]


@pytest.mark.parametrize("case, body, param, needle", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_400_naming_the_parameter(
    server: Server, tokenizer: Any, case: str, body: Any, param: str | None, needle: str
) -> None:
    before = len(server.backend.received)
    resp = server.post("/generate", data=body) if isinstance(body, bytes) else server.post("/generate", body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert needle in error["message"]
    if param is not None and param not in ("sampling_params",):
        assert param.split("[")[0] in error["message"]
    assert len(server.backend.received) == before  # nothing reached the scheduler
    assert_good_generation(server, tokenizer)


def test_context_overflow_message_states_both_numbers(server: Server) -> None:
    msg = server.post("/generate", TOO_LONG).json()["error"]["message"]
    assert "10 tokens" in msg and f"({CONTEXT_LENGTH - 9})" in msg and f"({CONTEXT_LENGTH})" in msg


def test_batch_requests_keep_order(server: Server, tokenizer: Any) -> None:
    resp = server.post(
        "/generate",
        {
            "input_ids": [[11, 12, 13, 14], [21, 22, 23]],
            "rid": ["b0", "b1"],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 2}],
        },
    )
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    assert [o["meta_info"]["id"] for o in outs] == ["b0", "b1"]
    assert [o["output_ids"] for o in outs] == [[12, 13, 14], [21, 22]]  # last 3 ids, cut to max_new_tokens
    texts = server.post("/generate", {"text": ["one two three four", "five six seven"]}).json()
    assert [t["output_ids"] for t in texts] == [
        tokenizer(s)["input_ids"][-3:] for s in ("one two three four", "five six seven")
    ]
    # each batch reached the scheduler in one message, so its requests start in one step
    assert [[m.rid for m in batch] for batch in server.backend.sent_lists[-2:]] == [
        [o["meta_info"]["id"] for o in outs],
        [t["meta_info"]["id"] for t in texts],
    ]


def test_streaming_sends_cumulative_chunks_then_done(server: Server, tokenizer: Any) -> None:
    resp = server.post("/generate", {"text": "Streaming ok 😀", "stream": True}, stream=True)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [line for line in resp.iter_lines(decode_unicode=False) if line]
    assert all(e.startswith(b"data: ") for e in events) and events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    ids = tokenizer("Streaming ok 😀")["input_ids"][-3:]  # " ok", then the emoji in two byte tokens
    assert "\ufffd" in tokenizer.decode(ids[1:2]) and "\ufffd" not in tokenizer.decode(ids)
    assert chunks and chunks[-1]["output_ids"] == ids
    assert (
        chunks[-1]["text"] == tokenizer.decode(ids)
        and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    )
    for earlier, later in zip(chunks, chunks[1:]):
        assert later["text"].startswith(earlier["text"]) and earlier["meta_info"]["finish_reason"] is None
    assert all("\ufffd" not in c["text"] for c in chunks)


def test_incremental_streaming_sends_disjoint_chunks(
    tmp_path: Path, smollm2_dir: Path, tokenizer: Any
) -> None:
    srv = Server(
        tmp_path, smollm2_dir, tokenizer, ServerArgs(random_seed=7, incremental_streaming_output=True)
    )
    try:
        text = "Streaming ok 😀"
        ids = tokenizer(text)["input_ids"][-3:]  # the fake backend's output: " ok", the emoji's two tokens
        resp = srv.post("/generate", {"text": text, "stream": True}, stream=True)
        events = [line for line in resp.iter_lines(decode_unicode=False) if line]
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
        # updates that arrive together go out as one chunk: disjoint pieces, whatever their number
        assert [i for c in chunks for i in c["output_ids"]] == ids, chunks
        assert "".join(c["text"] for c in chunks) == tokenizer.decode(ids)
        assert all("\ufffd" not in c["text"] for c in chunks)  # half an emoji is held back
        totals = list(itertools.accumulate(len(c["output_ids"]) for c in chunks))
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == totals and totals[-1] == 3  # totals
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        whole = srv.post("/generate", {"text": text}).json()  # not streamed: the whole output, as before
        assert whole["output_ids"] == ids and whole["text"] == tokenizer.decode(ids)
    finally:
        srv.close()


def test_incremental_output_slices_text_ids_and_output_logprobs() -> None:
    logprobs = LogprobMeta(top_logprobs_num=1, logprob_start_len=0, decode=None)
    state = ReqState("r", 2, asyncio.Event(), None, logprobs)
    logprobs.add(
        TokenLogprobs([-0.5], [7], [([-0.5], [7])]),
        TokenLogprobs([None, -1.0], [1, 2], [None, ([-1.0], [2])]),
    )
    state.text, state.output_ids = "a", [7]
    first = state.to_output(incremental=True)
    assert (first["text"], first["output_ids"]) == ("a", [7])
    assert first["meta_info"]["output_token_logprobs"] == [[-0.5, 7, None]]
    assert first["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]
    logprobs.add(TokenLogprobs([-0.25, -2.0], [8, 9], [([-0.25], [8]), ([-2.0], [9])]), None)
    state.text, state.output_ids = "abc", [7, 8, 9]
    second = state.to_output(incremental=True)
    assert (second["text"], second["output_ids"]) == ("bc", [8, 9])
    assert second["meta_info"]["output_token_logprobs"] == [[-0.25, 8, None], [-2.0, 9, None]]
    assert second["meta_info"]["output_top_logprobs"] == [[[-0.25, 8, None]], [[-2.0, 9, None]]]
    assert "input_token_logprobs" not in second["meta_info"]  # the first chunk carried them
    assert state.to_output(incremental=True)["output_ids"] == []  # nothing new
    cumulative = state.to_output()
    assert cumulative["text"] == "abc" and cumulative["output_ids"] == [7, 8, 9]
    assert (
        len(cumulative["meta_info"]["output_token_logprobs"]) == 3
        and "input_token_logprobs" in cumulative["meta_info"]
    )


def test_sse_events_are_utf8_json_and_the_server_runs_uvloop_and_httptools() -> None:
    # raw UTF-8 as json.dumps(ensure_ascii=False) wrote it, not \\u escapes; one event per chunk
    event = sse({"text": "é 😀", "output_ids": [1, 2], "meta_info": {"finish_reason": None}})
    assert event == 'data: {"text":"é 😀","output_ids":[1,2],"meta_info":{"finish_reason":null}}\n\n'.encode()
    config = uvicorn_config(FastAPI(), "127.0.0.1", 0)
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    assert config.get_loop_factory() is uvloop.new_event_loop


def test_abort_request_route_ends_a_running_request(server: Server) -> None:
    result: dict[str, requests.Response] = {}
    waiter = threading.Thread(
        target=lambda: result.update(r=server.post("/generate", {"text": "x", "rid": "hold-a"}))
    )
    waiter.start()
    server.backend.wait_for(lambda m: isinstance(m, TokenizedGenerateReq) and m.rid == "hold-a")
    resp = server.post("/abort_request", {"rid": "hold-a"})
    assert resp.status_code == 200 and resp.json() == {"rid": "hold-a", "in_flight": True}
    waiter.join(10)
    assert result["r"].status_code == 200
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    bad = server.post("/abort_request", {"rid": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"


def test_client_disconnect_aborts(server: Server) -> None:
    resp = server.post("/generate", {"text": "x", "rid": "hold-stream", "stream": True}, stream=True)
    server.backend.wait_for(lambda m: isinstance(m, TokenizedGenerateReq) and m.rid == "hold-stream")
    resp.close()
    server.backend.wait_for(lambda m: isinstance(m, AbortReq) and m.rid == "hold-stream")
    # Non-streaming: send the request by hand and hang up without reading the answer.
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"text": "x", "rid": "hold-plain"}).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        server.backend.wait_for(lambda m: isinstance(m, TokenizedGenerateReq) and m.rid == "hold-plain")
    server.backend.wait_for(lambda m: isinstance(m, AbortReq) and m.rid == "hold-plain")
    assert "hold-plain" not in server.tm.rid_to_state


def test_info_control_and_health_routes(server: Server) -> None:
    assert requests.get(server.url + "/health", timeout=10).json() == {}
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200
    model_info = requests.get(server.url + "/model_info", timeout=10).json()
    assert {
        k: model_info[k] for k in ("model_path", "tokenizer_path", "is_generation", "served_model_name")
    } == {
        "model_path": "/models/fake",
        "tokenizer_path": server.tm.tokenizer_path,
        "is_generation": True,
        "served_model_name": "SmolLM2-135M-Instruct",
    }  # ServerArgs without --model-path: the bundled model
    # SGLang's router and clients read these too (its GetModelInfo shape)
    assert {"model_type", "architectures", "weight_version", "preferred_sampling_params"} <= model_info.keys()
    info = requests.get(server.url + "/server_info", timeout=10).json()
    assert info["tp_size"] == 1 and info["internal_states"] == [{"fake_state": 1}]
    # SGLang's older route names answer the same
    old_names = requests.get(server.url + "/get_model_info", timeout=10).json()
    assert old_names["served_model_name"] == "SmolLM2-135M-Instruct"
    assert requests.get(server.url + "/get_server_info", timeout=10).json()["internal_states"] == [
        {"fake_state": 1}
    ]
    assert server.post("/flush_cache", {}).json() == {"success": True}
    cleared = server.post("/hicache/storage-backend/clear", {})  # SGLang's route: no disk tier here
    assert cleared.status_code == 400 and "--enable-hierarchical-cache" in cleared.text


def test_control_without_reply_times_out(fresh_server: Server) -> None:
    fresh_server.backend.answer_control = False
    requests.get(fresh_server.url + "/health", timeout=10)
    loop = fresh_server.tm._loop
    assert loop is not None
    future = asyncio.run_coroutine_threadsafe(fresh_server.tm.flush_cache(timeout=0.3), loop)
    with pytest.raises(ServiceUnavailableError, match="0.3 s"):
        future.result(10)


def test_fail_all_ends_in_flight_and_refuses_new_requests(fresh_server: Server) -> None:
    srv = fresh_server
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    results: dict[str, Any] = {}

    def plain() -> None:
        results["plain"] = srv.post("/generate", {"text": "x", "rid": "hold-p"})

    def streamed() -> None:
        resp = srv.post("/generate", {"text": "x", "rid": "hold-s", "stream": True}, stream=True)
        results["stream"] = (resp.status_code, [line for line in resp.iter_lines() if line])

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    for rid in ("hold-p", "hold-s"):
        srv.backend.wait_for(lambda m, rid=rid: isinstance(m, TokenizedGenerateReq) and m.rid == rid)
    srv.tm.fail_all("scheduler rank 1 exited with code -9")  # from a non-loop thread, like supervision
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    plain_resp = results["plain"]
    assert plain_resp.status_code == 503
    assert plain_resp.json() == {
        "error": {
            "message": "scheduler rank 1 exited with code -9",
            "type": "ServiceUnavailable",
            "code": 503,
        }
    }
    status, events = results["stream"]
    assert status == 200 and events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][len(b"data: ") :])["error"]["code"] == 503
    assert requests.get(srv.url + "/health", timeout=10).status_code == 503
    new = srv.post("/generate", {"text": "hello"})
    assert new.status_code == 503 and "rank 1" in new.json()["error"]["message"]
    assert srv.post("/generate", {"text": "hello", "stream": True}).status_code == 503
    assert requests.get(srv.url + "/health_generate", timeout=10).status_code == 503


def test_seeds_are_request_given_or_derived_deterministically(tmp_path: Path, smollm2_dir: Path) -> None:
    def manager(seed: int) -> TokenizerManager:
        return TokenizerManager(
            ServerArgs(random_seed=seed),
            PortArgs.create("tcp://127.0.0.1:1"),
            str(smollm2_dir),
            {
                "context_length": 256,
                "vocab_size": VOCAB_SIZE,
                "max_total_tokens": None,
                "eos_token_ids": [2],
                "model_path": "m",
            },
        )

    def seeds(tm: TokenizerManager) -> list[int]:
        return [req.seed for _ in range(2) for req in tm.parse_generate({"input_ids": [[1], [2]]}).reqs]

    first, again, other = seeds(manager(1)), seeds(manager(1)), seeds(manager(2))
    assert first == again and first != other and len(set(first)) == len(first)
    tm = manager(1)
    call = tm.parse_generate({"text": "hi there", "sampling_params": {"seed": 123}, "stream": True})
    assert call.reqs[0].seed == 123 and call.stream and not call.is_batch
    assert call.reqs[0].input_ids == tm.tokenizer("hi there")["input_ids"]


def test_tokenize_and_detokenize_use_the_served_tokenizer(server: Server, tokenizer: Any) -> None:
    """SGLang's /tokenize and /detokenize (also under /v1): single and batched, special tokens on or
    off; nothing reaches the backend."""
    ids = tokenizer("Hello big world")["input_ids"]
    plain = tokenizer("Hello big world", add_special_tokens=False)["input_ids"]
    backend_saw = len(server.backend.received)
    for prefix in ("", "/v1"):
        assert server.post(prefix + "/tokenize", {"prompt": "Hello big world"}).json() == {
            "tokens": ids,
            "count": len(ids),
            "max_model_len": CONTEXT_LENGTH,
        }
        batch = server.post(
            prefix + "/tokenize", {"prompt": ["Hello big world", "hi"], "add_special_tokens": False}
        )
        assert batch.json()["tokens"] == [plain, tokenizer("hi", add_special_tokens=False)["input_ids"]]
        assert batch.json()["count"] == [
            len(plain),
            len(tokenizer("hi", add_special_tokens=False)["input_ids"]),
        ]
        assert server.post(prefix + "/detokenize", {"tokens": plain}).json() == {
            "text": tokenizer.decode(plain)
        }
        both = server.post(
            prefix + "/detokenize", {"tokens": [plain, [1, *plain]], "skip_special_tokens": False}
        )
        assert both.json() == {"text": [tokenizer.decode(plain), tokenizer.decode([1, *plain])]}
    for path, body, param in [
        ("/tokenize", {"prompt": ""}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": []}, "prompt"),
        ("/tokenize", {"text": "x"}, "text"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [VOCAB_SIZE]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [[1], ["a"]]}, "tokens"),
    ]:
        r = server.post(path, body)
        if param is None:  # an empty prompt is fine: no tokens (but the special ones)
            assert r.status_code == 200 and r.json()["count"] == len(tokenizer("")["input_ids"])
            continue
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert len(server.backend.received) == backend_saw
