"""The OpenAI-compatible routes, driven by the official `openai` client against one real SmolLM2
server: the answers equal /generate's for the same greedy request, streamed deltas add up to the
non-streamed answer, usage adds up, logprobs equal /generate's (streamed too), n > 1 returns n
seeded choices, and bad or unsupported parameters get a 400 naming them, as do invalid
conversations (a role, a tool result that answers no call, a content part type) by the field's path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import requests
from server_fixture import Server
from transformers import AutoTokenizer

from srt.generate_parse import RequestError
from srt.openai_parse import chat_prompt

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a long story about a dragon who learns to read."},
]
PROMPT = "The three most important inventions in history are"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--dtype", "float32", "--max-total-tokens", "16384") as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate_text(server: Server, **prompt: Any) -> dict[str, Any]:
    r = server.generate({**prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_models_list_names_the_served_model(server: Server, client: openai.OpenAI) -> None:
    info = requests.get(server.url + "/model_info", timeout=10).json()
    # no --model-path: the bundled model's name, not the cache folder its GGUF was converted into
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    reply = client.completions.create(model="anything", prompt=PROMPT, max_tokens=1)
    assert reply.model == "SmolLM2-135M-Instruct"


def test_models_retrieve_gives_the_served_model_and_404_for_another(client: openai.OpenAI) -> None:
    """The SDK's models.retrieve: the served model's card, and OpenAI's NotFoundError (a 404 naming
    the model) for an id the server does not serve."""
    card = client.models.retrieve("SmolLM2-135M-Instruct")
    assert (card.id, card.object, card.owned_by) == ("SmolLM2-135M-Instruct", "model", "srt")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/other-model")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found" and error["param"] == "model", error
    assert "org/other-model" in error["message"]


def test_chat_completion_matches_generate_on_the_templated_prompt(
    server: Server, client: openai.OpenAI, tokenizer: Any
) -> None:
    reply = client.chat.completions.create(model="anything", messages=MESSAGES, temperature=0, max_tokens=8)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt_ids = tokenizer(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 8)
    assert reply.usage.total_tokens == len(prompt_ids) + 8
    assert choice.message.content == generate_text(server, input_ids=prompt_ids)["text"]
    # max_completion_tokens is the newer name for the same limit.
    again = client.chat.completions.create(
        model="anything", messages=MESSAGES, temperature=0, max_completion_tokens=8
    )
    assert again.choices[0].message.content == choice.message.content


def test_streamed_chat_adds_up_to_the_full_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    content_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in content_chunks[1:])
    assert (
        "".join(c.choices[0].delta.content or "" for c in content_chunks) == full.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None and full.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert len({c.id for c in chunks}) == 1
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_completions_match_generate(server: Server, client: openai.OpenAI, tokenizer: Any) -> None:
    expected = generate_text(server, text=PROMPT)
    reply = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=8)
    assert reply.choices[0].text == expected["text"] and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        expected["meta_info"]["prompt_tokens"],
        8,
        expected["meta_info"]["prompt_tokens"] + 8,
    )
    by_ids = client.completions.create(
        model="m", prompt=tokenizer(PROMPT)["input_ids"], temperature=0, max_tokens=8
    )
    assert by_ids.choices[0].text == expected["text"]
    streamed = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected["text"]


def test_completions_default_to_16_tokens_and_honour_stop(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="m", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    text = reply.choices[0].text
    stop = text.strip().split()[1]  # a word the greedy answer is known to contain
    cut = client.completions.create(model="m", prompt=PROMPT, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 20000}, "max_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 2.5}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"extra_body": {"continue_final_message": True}},
            "continue_final_message",
        ),  # the last message is the user's
        ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
    ],
)
def test_bad_chat_parameters_get_a_400_naming_them(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, **kwargs)
    body = info.value.body
    assert isinstance(body, dict)
    assert (body.get("param"), body.get("type"), body.get("code")) == (param, "invalid_request_error", None)


def test_bad_completion_input_gets_a_400_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ({"prompt": PROMPT, "n": 500}, "n"),
        ({"prompt": PROMPT, "suffix": "and"}, "suffix"),
        ({"prompt": PROMPT, "best_of": 3}, "best_of"),
        ({"prompt": PROMPT, "extra_body": {"bogus": 1}}, "bogus"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="m", max_tokens=2, **kwargs)
        assert isinstance(info.value.body, dict) and info.value.body.get("param") == param, kwargs
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(
        openai.BadRequestError, match=r"messages\[1\]\.content is required for a user message"
    ):
        client.chat.completions.create(model="m", messages=[MESSAGES[0], {"role": "user"}])  # type: ignore[list-item]
    assert (
        client.chat.completions.create(  # an assistant turn without content (it had only tool calls) is fine
            model="m", max_tokens=2, messages=[*MESSAGES, {"role": "assistant"}, MESSAGES[1]]
        )
        .choices[0]
        .message.content
    )
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2).choices[0].text


CALL: Any = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
CALLED: list[Any] = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
ANSWER: Any = {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 9 C"}
TEXT_PART: Any = {"type": "text", "text": "Hello"}
# conversations OpenAI refuses, and the field its 400 names
INVALID_CONVERSATIONS: list[tuple[list[Any], str]] = [
    ([MESSAGES[0], {"role": "wizard", "content": "Abracadabra"}], "messages[1].role"),
    ([{"content": "Hi"}], "messages[0].role"),
    ([{"role": ["user"], "content": "Hi"}], "messages[0].role"),
    ([{**CALLED[2], "tool_calls": [{**CALL, "id": ["call_1"]}]}, ANSWER], "messages[0].tool_calls[0].id"),
    ([*MESSAGES, {"role": "tool", "content": "Rain, 9 C"}], "messages[2].tool_call_id"),  # no id
    ([*MESSAGES, ANSWER], "messages[2].tool_call_id"),  # no call before it
    ([*CALLED, {**ANSWER, "tool_call_id": "call_2"}], "messages[3].tool_call_id"),  # not that call's id
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}, *CALLED], "messages[0].tool_call_id"),
    (
        [{"role": "user", "content": [TEXT_PART, {"type": "video", "video": "v"}]}],
        "messages[0].content[1].type",
    ),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        "messages[0].content[0]",
    ),
]


def test_invalid_conversations_are_refused_naming_the_field(tokenizer: Any) -> None:
    """Roles, tool results and content parts as OpenAI checks them, on the chat parser alone."""
    tm: Any = SimpleNamespace(tokenizer=tokenizer, server_args=SimpleNamespace(tool_call_parser=None))
    for messages, param in INVALID_CONVERSATIONS:
        with pytest.raises(RequestError) as info:
            chat_prompt(tm, {"messages": messages})
        assert info.value.param == param and param in str(info.value), (messages, str(info.value))
    # the valid forms still render: a tool loop, each role, text parts and an assistant's refusal
    developer = {"role": "developer", "content": [TEXT_PART, TEXT_PART]}
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    assert chat_prompt(tm, {"messages": [*CALLED, ANSWER, developer, refusal, MESSAGES[1]]}).input_ids


def test_invalid_conversations_get_openais_400_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    for messages, param in INVALID_CONVERSATIONS:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=messages, max_tokens=2)
        body = info.value.body
        assert isinstance(body, dict) and (body["param"], body["type"]) == (param, "invalid_request_error")
        assert param in body["message"]
    assert client.chat.completions.create(model="m", messages=[*CALLED, ANSWER], max_tokens=2).choices


def direct_ids(server: Server) -> list[int]:
    r = server.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    return r.json()["output_ids"]  # type: ignore[no-any-return]


def test_penalties_pass_through_to_generate(server: Server, client: openai.OpenAI) -> None:
    penalties = {"frequency_penalty": 1.0, "presence_penalty": 0.5}
    reply = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"repetition_penalty": 1.2},
        **penalties,
    )  # type: ignore[arg-type]
    direct = server.generate(
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "repetition_penalty": 1.2,
                **penalties,
            },
        }
    )
    assert reply.choices[0].text == direct.json()["text"]
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0)
    assert plain.choices[0].text != reply.choices[0].text
    first = direct_ids(server)[
        0
    ]  # the plain greedy run's first token, as a stop id: min_tokens holds it back
    early = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    held = client.completions.create(
        model="m",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 5},
    )
    assert early.usage is not None and early.usage.completion_tokens == 1
    assert held.usage is not None and held.usage.completion_tokens >= 5


def generate_logprobs(server: Server, top: int, **prompt: Any) -> dict[str, Any]:
    r = server.generate(
        {
            **prompt,
            "return_logprob": True,
            "top_logprobs_num": top,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        }
    )
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]  # type: ignore[no-any-return]


def test_completion_logprobs_match_generate_streamed_or_not(server: Server, client: openai.OpenAI) -> None:
    meta = generate_logprobs(server, 3, text=PROMPT)
    reply = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert logprobs.tokens == [e[2] for e in meta["output_token_logprobs"]]
    assert logprobs.token_logprobs == [e[0] for e in meta["output_token_logprobs"]]
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    for chosen, value, top, ranked in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, meta["output_top_logprobs"]
    ):
        assert top[chosen] == value  # the chosen token is always listed (up to logprobs + 1 entries)
        assert {e[2]: e[0] for e in ranked}.items() <= top.items() and len(top) <= 4
    chunks = list(
        client.completions.create(
            model="m", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens or []] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs or []] == logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset or []] == logprobs.text_offset


def test_chat_logprobs_match_generate_streamed_or_not(
    server: Server, client: openai.OpenAI, tokenizer: Any
) -> None:
    prompt_ids = tokenizer(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    meta = generate_logprobs(server, 2, input_ids=prompt_ids)
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
    }
    reply = client.chat.completions.create(**kwargs)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert [(c.token, c.logprob) for c in content] == [(e[2], e[0]) for e in meta["output_token_logprobs"]]
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    for item in content:
        assert item.bytes == list(item.token.encode("utf-8"))
        assert (
            len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        )  # greedy: the best one
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(**kwargs, stream=True)]
    assert [(c.token, c.logprob) for lp in streamed if lp is not None for c in lp.content or []] == [
        (c.token, c.logprob) for c in content
    ]
    # Without logprobs the choice has none.
    assert (
        client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None, "max_tokens": 1})
        .choices[0]
        .logprobs
        is None
    )


def test_n_choices_are_seeded_and_streamed_by_index(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "m",
        "prompt": PROMPT,
        "temperature": 1.0,
        "max_tokens": 8,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    reply = client.completions.create(**kwargs, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    texts = [c.text for c in reply.choices]
    assert texts[0] != texts[1]  # two different seeds
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert client.completions.create(**kwargs).choices[0].text == texts[0]  # choice 0 keeps the seed itself
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, n=2, stream=True):  # seeded: the same choices again
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(2)] == texts
    chat = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, n=2, seed=1)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)


def test_a_generating_server_refuses_embeddings(server: Server) -> None:
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})):
        reply = requests.post(server.url + path, json=body, timeout=30)
        assert reply.status_code == 400 and "--is-embedding" in reply.json()["error"]["message"]
