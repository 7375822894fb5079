"""Anthropic's Messages API on the default server (SmolLM2, bf16, the C kernels), driven by the
official `anthropic` client: a reply equals the chat completion of the same conversation, streams
in Anthropic's event order to the same text, stops on a stop sequence, counts its tokens, forces a
tool call that parses back as a `tool_use` block and completes the round trip with a `tool_result`,
ends a forced turn (a named tool: one `tool_use`; `any`: no call repeated) with `tool_use`, runs
a three-turn tool loop (ask, forced call, result, answer) to `end_turn`, streamed or not;
bad fields and invalid conversations (a role, a tool_result that answers no tool_use, a tool without
a name) are 400s in Anthropic's shape naming them, and the API key passes as `x-api-key`. The
thinking blocks of `--reasoning-parser` are checked on made-up outputs (a random model does not
think, and the Messages API has no regex to make it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import anthropic
import openai
import pytest
import requests
from chat_outputs import THINKING, WEATHER, made_up_outputs
from server_fixture import Server

from srt.anthropic_api import message, stream_events
from srt.anthropic_parse import chat_request
from srt.conversation import Message, TextPart
from srt.conversation.call import ChatCall
from srt.generate_parse import RequestError
from srt.reasoning import ReasoningSplit

KEY = "sk-test-anthropic"
TOOLS: Any = [
    {"name": "get_weather", "description": "The weather forecast for a city", "input_schema": WEATHER}
]
ASK: Any = [{"role": "user", "content": "Will it rain in Oslo tomorrow?"}]
# the official client (2.17) no longer sends sampling fields itself; srt takes them, as SGLang
GREEDY = {"temperature": 0}
STORY: Any = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--max-total-tokens", "4096", "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, messages: Any = STORY, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 24)
    return client.messages.create(model="m", messages=messages, extra_body=GREEDY, **kwargs)


def prompt_tokens(usage: Any) -> int:
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


def test_a_reply_is_the_chat_completion_of_the_same_conversation(
    server: Server, client: anthropic.Anthropic
) -> None:
    system = "You are a poet."
    reply = create(client, system=system)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert (
        reply.model
        == requests.get(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=30).json()["data"][0][
            "id"
        ]
    )
    (block,) = reply.content
    assert block.type == "text" and block.text
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 24
    # Both prefill the whole prompt: outside --enable-deterministic-inference a prompt's last token
    # extended after a cached prefix need not have the bits of the same token in a whole prefill.
    flushed = requests.post(server.url + "/flush_cache", headers={"x-api-key": KEY}, timeout=30)
    assert flushed.status_code == 200, flushed.text
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    same = chat.chat.completions.create(
        model="m", messages=[{"role": "system", "content": system}, *STORY], temperature=0, max_tokens=24
    )
    assert block.text == same.choices[0].message.content
    assert same.usage is not None
    assert prompt_tokens(reply.usage) == same.usage.prompt_tokens
    counted = client.messages.count_tokens(model="m", messages=STORY, system=system)
    assert counted.input_tokens == same.usage.prompt_tokens


def test_a_stream_sends_anthropics_events_and_the_same_text(client: anthropic.Anthropic) -> None:
    whole = create(client)
    with client.messages.stream(model="m", messages=STORY, extra_body=GREEDY, max_tokens=24) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24


def test_a_stop_sequence_ends_the_reply_and_is_named(client: anthropic.Anthropic) -> None:
    text = create(client).content[0].text
    word = text.split()[3]  # a word the greedy reply writes
    reply = create(client, stop_sequences=["zzzz", word])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word
    assert text.startswith(reply.content[0].text) and word not in reply.content[0].text


def test_a_forced_tool_call_parses_and_the_round_trip_completes(client: anthropic.Anthropic) -> None:
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = create(client, ASK, tools=TOOLS, tool_choice=forced, max_tokens=60)
    assert first.stop_reason == "tool_use", first
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input["city"] in WEATHER["properties"]["city"]["enum"]  # type: ignore[index]
    with client.messages.stream(
        model="m",
        messages=ASK,
        extra_body=GREEDY,
        max_tokens=60,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        streamed = stream.get_final_message()
    (again,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (
        streamed.stop_reason == "tool_use" and again.input == call.input
    )  # the SDK rebuilt it from the deltas
    # the client's usual second turn: the assistant's tool_use sent back, its result in a user turn
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Rain, 9 C"}
    turns = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = create(client, turns, tools=TOOLS, max_tokens=8)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the call and its result were rendered: the prompt grew (Anthropic counts its cached part apart)
    assert prompt_tokens(second.usage) > prompt_tokens(first.usage) + 10
    assert client.messages.count_tokens(model="m", messages=turns, tools=TOOLS).input_tokens == prompt_tokens(
        second.usage
    )


def tool_uses(client: anthropic.Anthropic, tool_choice: Any, stream: bool) -> tuple[str | None, list[Any]]:
    """(stop_reason, [(name, input)]) of a greedy reply that must use a tool; max_tokens far beyond
    a few calls, the clients' default parallel calls."""
    kwargs: Any = {"model": "m", "messages": ASK, "max_tokens": 2048, "extra_body": GREEDY}
    kwargs.update(tools=TOOLS, tool_choice=tool_choice)
    if stream:
        with client.messages.stream(**kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**kwargs)
    return reply.stop_reason, [(b.name, b.input) for b in reply.content if b.type == "tool_use"]


def test_tool_turns_end_one_named_tool_use_and_no_repeated_any_call(client: anthropic.Anthropic) -> None:
    quick = client.with_options(timeout=60)  # before, `any` wrote the same call until max_tokens
    for stream in (False, True):
        stop, calls = tool_uses(quick, {"type": "tool", "name": "get_weather"}, stream)
        assert stop == "tool_use" and [name for name, _ in calls] == ["get_weather"], (stream, calls)
    whole, streamed = tool_uses(quick, {"type": "any"}, False), tool_uses(quick, {"type": "any"}, True)
    assert whole == streamed
    stop, calls = whole
    assert stop == "tool_use" and calls, whole
    assert all(call not in calls[:i] for i, call in enumerate(calls)), calls  # no call repeated


def turn(client: anthropic.Anthropic, stream: bool, messages: Any, **kwargs: Any) -> Any:
    """One greedy reply; streamed, the SDK's message rebuilt from the events."""
    if not stream:
        return create(client, messages, **kwargs)
    with client.messages.stream(model="m", messages=messages, extra_body=GREEDY, **kwargs) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_of_three_turns_ends_with_an_answer(client: anthropic.Anthropic, stream: bool) -> None:
    """The agent loop a client runs: the user asks, the model uses the tool (the choice forces it:
    the bundled model is too small to decide), the client sends the result back and the model
    answers; each turn is accepted and ends by itself, not at max_tokens."""
    kwargs: Any = {"tools": TOOLS, "max_tokens": 256}
    called = turn(client, stream, ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kwargs)
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"], called
    (use,) = called.content
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input["city"]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Rain, 9 C"}
    turns = [*ASK, {"role": "assistant", "content": called.content}, {"role": "user", "content": [result]}]
    answer = turn(client, stream, turns, tool_choice={"type": "none"}, **kwargs)
    assert answer.stop_reason == "end_turn" and [b.type for b in answer.content] == ["text"], answer
    assert answer.content[0].text


def refusal(client: anthropic.Anthropic, **kwargs: Any) -> str:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**{"model": "m", "messages": STORY, "max_tokens": 4, **kwargs})
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def test_bad_fields_are_400s_naming_them(server: Server, client: anthropic.Anthropic) -> None:
    assert "frobnicate" in refusal(client, extra_body={"frobnicate": 1})
    assert "temperature" in refusal(client, extra_body={"temperature": -1.0})
    # Anthropic's own ranges, not OpenAI's: temperature and top_p 0-1, top_k a count
    assert "temperature: must be a number from 0 to 1" in refusal(client, extra_body={"temperature": 3})
    assert "top_p" in refusal(client, extra_body={"top_p": 1.5})
    assert "top_k" in refusal(client, extra_body={"top_k": -2})
    assert "stop_sequences" in refusal(client, stop_sequences=[""])
    assert "container" in refusal(client, extra_body={"container": "c1"})
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    message = refusal(client, messages=[{"role": "user", "content": [image]}])
    assert "image" in message and "messages[0].content[0]" in message
    web = {"type": "web_search_20250305", "name": "web_search"}
    assert "web_search_20250305" in refusal(client, tools=[web])
    assert "tool_choice" in refusal(client, tool_choice={"type": "tool", "name": "nope"}, tools=TOOLS)
    missing = requests.post(
        server.url + "/v1/messages",
        json={"model": "m", "messages": STORY},
        headers={"x-api-key": KEY},
        timeout=30,
    )
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    assert create(client, max_tokens=2).usage.output_tokens == 2  # and the server goes on serving


USE: Any = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
USED: Any = [*ASK, {"role": "assistant", "content": [USE]}]
RESULT: Any = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain, 9 C"}
# (messages, tools) Anthropic refuses, and the field its 400 names
INVALID_CONVERSATIONS: list[tuple[Any, Any, str]] = [
    ([*ASK, {"role": "user", "content": [RESULT]}], None, "messages[1].content[0].tool_use_id"),  # no call
    (
        [
            *USED,
            {"role": "user", "content": [{"type": "text", "text": "so?"}, {**RESULT, "tool_use_id": "x"}]},
        ],
        None,
        "messages[2].content[1].tool_use_id",
    ),
    (
        [*USED, {"role": "user", "content": [{**RESULT, "tool_use_id": None}]}],
        None,
        "messages[2].content[0].tool_use_id",
    ),
    (
        [{"role": "user", "content": [RESULT]}, *USED[1:]],
        None,
        "messages[0].content[0].tool_use_id",
    ),  # too early
    ([{"role": "wizard", "content": "Abracadabra"}], None, "messages[0].role"),
    ([*ASK, {"role": "system", "content": "Be brief."}], None, "messages[1].role"),
    (ASK, [{"description": "no name", "input_schema": WEATHER}], "tools[0].name"),
    (ASK, [*TOOLS, {"name": "", "input_schema": WEATHER}], "tools[1].name"),
    (ASK, [{"name": "get weather", "input_schema": WEATHER}], "tools[0].name"),
]


def test_invalid_conversations_are_refused_naming_the_field() -> None:
    """Roles, tool results and tool names as Anthropic checks them, under Anthropic's paths."""
    for messages, tools, path in INVALID_CONVERSATIONS:
        with pytest.raises(RequestError) as info:
            chat_request({"messages": messages, "tools": tools})
        assert info.value.param == path and path in str(info.value), (messages, tools, str(info.value))
    conversation = chat_request(
        {"messages": [*USED, {"role": "user", "content": [RESULT]}], "tools": TOOLS}
    ).conversation
    assert conversation.messages[-1] == Message("tool", (TextPart("Rain, 9 C"),), call_id="toolu_1")


def test_invalid_conversations_get_anthropics_400_and_the_server_keeps_serving(
    client: anthropic.Anthropic,
) -> None:
    for messages, tools, path in INVALID_CONVERSATIONS:
        message = refusal(client, messages=messages, **({"tools": tools} if tools else {}))
        assert message.startswith(path) and "function" not in message, message
    turns = [*USED, {"role": "user", "content": [RESULT]}]
    assert create(client, turns, tools=TOOLS, max_tokens=2).usage.output_tokens == 2


def test_the_api_key_passes_as_x_api_key(server: Server) -> None:
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        stranger.messages.create(model="m", messages=STORY, max_tokens=2)
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    body = {"model": "m", "messages": STORY, "max_tokens": 2}
    url = server.url + "/v1/messages"
    assert requests.post(url, json=body, timeout=30).status_code == 401
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=30)
    assert bearer.messages.create(**body).usage.output_tokens == 2


# ---- thinking blocks, on made-up outputs ----
def _thinking_call() -> ChatCall:
    return ChatCall({}, True, {}, reasoning=ReasoningSplit("deepseek-r1"))


def test_thinking_comes_first_as_its_own_block() -> None:
    reply = message(_thinking_call(), made_up_outputs(THINKING)[-1], "m")
    assert [b["type"] for b in reply["content"]] == ["thinking", "text"]
    assert (
        reply["content"][0]["thinking"] == "Rain is likely"
        and reply["content"][1]["text"] == "Take an umbrella."
    )
    assert reply["stop_reason"] == "end_turn" and reply["usage"]["cache_read_input_tokens"] == 2


async def _events(texts: list[str]) -> list[dict[str, Any]]:
    async def outputs() -> AsyncGenerator[dict[str, Any], None]:
        for out in made_up_outputs(texts):
            yield out

    events = []
    async for part in stream_events(_thinking_call(), outputs(), "m"):
        kind, data = part.decode().strip().split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == "event: " + events[-1]["type"]
    return events


def test_a_stream_thinks_then_writes() -> None:
    events = asyncio.run(_events(THINKING))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "thinking"), (1, "text")]
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert thinking == "Rain is likely" and text == "Take an umbrella."
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1] and kinds.index("content_block_stop") < kinds.index("content_block_start", 2)


def test_every_field_of_the_official_client_is_in_the_table() -> None:
    import inspect

    from srt.anthropic_parse import COUNT_TOKENS, MESSAGES

    for method, table in (
        (anthropic.resources.Messages.create, MESSAGES),
        (anthropic.resources.Messages.count_tokens, COUNT_TOKENS),
    ):
        params = set(inspect.signature(method).parameters) - {
            "self",
            "extra_headers",
            "extra_query",
            "extra_body",
            "timeout",
        }
        assert params <= set(table), params - set(table)
