"""SGLang's and OpenAI's request vocabulary, generated from srt/request_fields.py's lists and sent through
the real HTTP app and TokenizerManager (a fake scheduler answers, as in test_frontend.py): every
field at SGLang's default is accepted, together and one by one, with the same result as a plain
request; every off-only field set to something else is a 400 naming it and saying it is not
supported; advisory fields take any value; a name in no list is a 400 naming it. Also the exact
bodies sglang-router 0.3.2 forwards (captured from it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_frontend import Server

from srt.io_struct import TokenizedGenerateReq
from srt.request_fields import CHAT, COMPLETION, GENERATE, SAMPLING, SOURCES, Field

PROMPT = "Hello big world"
MESSAGES = [{"role": "user", "content": "Say hi"}]
ROUTES: dict[str, tuple[str, dict[str, Field], dict[str, Any]]] = {
    "generate": ("/generate", GENERATE, {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}}),
    "completions": ("/v1/completions", COMPLETION, {"prompt": PROMPT, "max_tokens": 3}),
    "chat": ("/v1/chat/completions", CHAT, {"messages": MESSAGES, "max_tokens": 3}),
}
# The bodies sglang-router 0.3.2 sent a worker for plain requests (HTTP mode, cache_aware policy).
ROUTER_BODIES = {
    "generate": {
        "text": PROMPT,
        "model": None,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    },
    "completions": {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": 3,
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
    "chat": {
        "messages": MESSAGES,
        "model": "m",
        "logprobs": False,
        "max_completion_tokens": 3,
        "stream": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, tokenizer: Any) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("ipc"), smollm2_dir, tokenizer)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def at_defaults(vocabulary: dict[str, Field], given: dict[str, Any]) -> dict[str, Any]:
    """Every field of `vocabulary` at its default, with `given` on top."""
    return {**{name: field.default for name, field in vocabulary.items()}, **given}


def sent_request(server: Server, route: str, body: dict[str, Any]) -> TokenizedGenerateReq:
    before = len(server.backend.received)
    resp = server.post(route, body)
    assert resp.status_code == 200, resp.text
    sent = [m for m in server.backend.received[before:] if isinstance(m, TokenizedGenerateReq)]
    assert len(sent) == 1
    return sent[0]


def same_request(a: TokenizedGenerateReq, b: TokenizedGenerateReq) -> None:
    """Two requests the scheduler would serve alike (rids and resolved seeds aside)."""
    pa, pb = a.sampling_params, b.sampling_params
    assert a.input_ids == b.input_ids
    assert (
        pa.max_new_tokens,
        pa.temperature,
        pa.top_p,
        pa.min_p,
        pa.stop,
        pa.stop_token_ids,
        pa.logit_bias,
    ) == (pb.max_new_tokens, pb.temperature, pb.top_p, pb.min_p, pb.stop, pb.stop_token_ids, pb.logit_bias)
    assert (pa.top_k in (-1, 1 << 30)) and (pb.top_k in (-1, 1 << 30))  # both: every token
    assert (a.return_logprob, a.logprob_start_len, a.priority) == (
        b.return_logprob,
        b.logprob_start_len,
        b.priority,
    )


def non_default(field: Field) -> Any:
    """A value srt does not support for an off-only field."""
    flipped = [not field.default] if isinstance(field.default, bool) else [True]
    for value in (*flipped, 7, "srt-unsupported", ["srt"], {"srt": 1}):
        if not any(type(value) is type(v) and value == v for v in field.off_values):
            return value
    raise AssertionError(field)


def test_the_lists_name_their_source() -> None:
    assert "sglang 0.5.23" in SOURCES and "sglang-router 0.3.2" in SOURCES
    for vocabulary in (GENERATE, SAMPLING, COMPLETION, CHAT):
        assert all(field.kind in ("implemented", "off_only", "advisory") for field in vocabulary.values())


@pytest.mark.parametrize("name", list(ROUTES))
def test_every_field_at_its_default_is_accepted_at_once(server: Server, name: str) -> None:
    route, vocabulary, given = ROUTES[name]
    plain = sent_request(server, route, given)
    body = at_defaults(vocabulary, given)
    if name == "generate":
        body["input_ids"] = None  # text is the prompt here
        body["sampling_params"] = at_defaults(SAMPLING, given["sampling_params"])
    elif name == "completions":
        body["max_tokens"] = given["max_tokens"]
    same_request(sent_request(server, route, body), plain)


@pytest.mark.parametrize("name", list(ROUTES))
def test_each_field_at_its_default_is_accepted_alone(server: Server, name: str) -> None:
    route, vocabulary, given = ROUTES[name]
    plain = sent_request(server, route, given)
    for field_name, field in vocabulary.items():
        if field_name in given or field_name in ("text", "input_ids", "prompt", "messages"):
            continue
        same_request(sent_request(server, route, {**given, field_name: field.default}), plain)
    if name == "generate":
        for field_name, field in SAMPLING.items():
            params = {**given["sampling_params"], field_name: field.default}
            if field_name == "max_new_tokens":
                continue
            same_request(sent_request(server, route, {**given, "sampling_params": params}), plain)


def off_only_cases() -> list[tuple[str, str, Any]]:
    cases = []
    for name, (_, vocabulary, _) in ROUTES.items():
        cases += [
            (name, field_name, non_default(field))
            for field_name, field in vocabulary.items()
            if field.kind == "off_only"
        ]
    cases += [
        ("sampling", field_name, non_default(field))
        for field_name, field in SAMPLING.items()
        if field.kind == "off_only"
    ]
    return cases


@pytest.mark.parametrize(
    ("name", "field_name", "value"), off_only_cases(), ids=[f"{c[0]}-{c[1]}" for c in off_only_cases()]
)
def test_an_unsupported_value_is_a_400_naming_the_field(
    server: Server, name: str, field_name: str, value: Any
) -> None:
    route, _, given = ROUTES["generate" if name == "sampling" else name]
    if name == "sampling":
        body = {**given, "sampling_params": {**given["sampling_params"], field_name: value}}
    else:
        body = {**given, field_name: value}
    before = len(server.backend.received)
    resp = server.post(route, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field_name and "not supported" in error["message"], error
    assert len(server.backend.received) == before  # nothing reached the scheduler


@pytest.mark.parametrize("name", list(ROUTES))
def test_advisory_fields_take_any_value(server: Server, name: str) -> None:
    route, vocabulary, given = ROUTES[name]
    plain = sent_request(server, route, given)
    values = {name: "srt-any" for name, field in vocabulary.items() if field.kind == "advisory"}
    if "custom_labels" in values:
        values["custom_labels"] = {"team": "a"}
    assert values
    same_request(sent_request(server, route, {**given, **values}), plain)


@pytest.mark.parametrize("name", [*ROUTES, "sampling"])
def test_an_unknown_name_is_a_400_naming_it(server: Server, name: str) -> None:
    route, _, given = ROUTES["generate" if name == "sampling" else name]
    if name == "sampling":
        body = {**given, "sampling_params": {**given["sampling_params"], "temprature": 0.5}}
        unknown = "temprature"
    else:
        body, unknown = {**given, "lora_pth": None}, "lora_pth"
    resp = server.post(route, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == unknown and "unknown" in error["message"] and unknown in error["message"]


@pytest.mark.parametrize("name", list(ROUTER_BODIES))
def test_the_bodies_sglang_router_forwards_are_served(server: Server, name: str) -> None:
    route, _, given = ROUTES[name]
    body = ROUTER_BODIES[name]
    plain_body = (
        {**given, "sampling_params": {**given["sampling_params"], "temperature": 0.0}}
        if name == "generate"
        else given
    )
    same_request(sent_request(server, route, body), sent_request(server, route, plain_body))


def test_a_batch_may_give_an_off_only_field_per_item(server: Server) -> None:
    body = {"text": ["a b", "c d"], "lora_path": [None, None], "return_hidden_states": [False, False]}
    assert server.post("/generate", body).status_code == 200
    resp = server.post("/generate", {**body, "return_hidden_states": [False, True]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "return_hidden_states"
    # lora_path is implemented, and needs a server started with --enable-lora
    resp = server.post("/generate", {**body, "lora_path": [None, "adapter"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path"
