"""OpenAI's Responses API on the default server (SmolLM2, bf16, the C kernels), driven by the
official `openai` client: a response equals the chat completion of the same conversation, streams
in OpenAI's event order to the same text, stops at max_output_tokens as `incomplete`, forces a tool
call that parses back as a `function_call` item and completes the round trip with a
`function_call_output` (sent explicitly or through previous_response_id), ends a forced turn (a
named function: one call; `required`: no call repeated) as `completed`, and so does the chat
completion on the same server with `tool_calls`, runs a three-turn tool loop (ask, forced call,
result, answer) ending by itself, chat and Responses alike, streamed or not, follows a JSON
schema; generated and mutated conversations on the three chat routes are answered 200 or 400,
never a 500; stored responses are read and deleted, the oldest evicted first; bad fields and
invalid inputs (a role, a function_call_output that answers no call) are 400s in OpenAI's shape
naming them. Reasoning items are checked on made-up outputs (a random model does not think)."""

from __future__ import annotations

import asyncio
import inspect
import json
import random
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import requests
from chat_conversations import BUILDERS, generated, mutated
from chat_outputs import THINKING, WEATHER, made_up_outputs
from openai.resources.responses import Responses
from openai.resources.responses.input_tokens import InputTokens
from server_fixture import Server
from transformers import AutoTokenizer

from srt.conversation.call import ChatCall
from srt.generate_parse import RequestError
from srt.reasoning import ReasoningSplit
from srt.responses_api import response, stream_events
from srt.responses_parse import INPUT_TOKENS, RESPONSES, ResponsesCall, count_input_tokens, echo_settings
from srt.responses_store import ResponseStore

TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": WEATHER,
        "strict": True,
    }
]
FORCED: Any = {"type": "function", "name": "get_weather"}
ASK = "Will it rain in Oslo tomorrow?"
STORY = "Write a short story about a robot who learns to paint."
SYSTEM = "You are a poet."


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--max-total-tokens", "4096") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def create(client: openai.OpenAI, input: Any = STORY, **kwargs: Any) -> Any:
    kwargs.setdefault("max_output_tokens", 24)
    return client.responses.create(model="m", input=input, temperature=0, **kwargs)


def test_a_response_is_the_chat_completion_of_the_same_conversation(
    server: Server, client: openai.OpenAI
) -> None:
    reply = create(client, instructions=SYSTEM, max_output_tokens=48)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.model == requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    (item,) = reply.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    # the same prefill as the response's (a cached prompt's last token would be prefilled alone,
    # with arithmetic of its own)
    assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
    same = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": STORY}],
        temperature=0,
        max_tokens=48,
    )
    assert reply.output_text and reply.output_text == same.choices[0].message.content
    assert reply.usage is not None and same.usage is not None
    assert reply.usage.input_tokens == same.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.instructions == SYSTEM and reply.max_output_tokens == 48 and reply.temperature == 0
    counted = client.responses.input_tokens.count(model="m", input=STORY, instructions=SYSTEM)
    assert counted.input_tokens == same.usage.prompt_tokens
    if same.choices[0].finish_reason == "length":
        assert reply.status == "incomplete"
    short = create(client, instructions=SYSTEM, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens" and short.usage.output_tokens == 3
    assert short.output[0].status == "incomplete"


def test_a_stream_sends_openais_events_and_the_same_text(client: openai.OpenAI) -> None:
    whole = create(client)
    stream = client.responses.create(model="m", input=STORY, temperature=0, max_output_tokens=24, stream=True)
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # 24 tokens do not finish a story
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage.output_tokens == 24
    assert client.responses.retrieve(final.id).output_text == text  # a streamed response is stored too
    with client.responses.stream(model="m", input=STORY, temperature=0, max_output_tokens=24) as helper:
        (last,) = list(helper)[-1:]
    # the helper's get_final_response wants response.completed, which an incomplete response does
    # not send (OpenAI's neither); the forced tool call below completes and reads it
    assert last.type == "response.incomplete" and last.response.output_text == text


def _call(reply: Any) -> Any:
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    assert arguments["city"] in WEATHER["properties"]["city"]["enum"]  # type: ignore[index]
    assert arguments["days"] in (1, 2, 3)
    return call


def test_a_forced_function_call_parses_and_the_round_trip_completes(client: openai.OpenAI) -> None:
    forced = {"tools": TOOLS, "tool_choice": FORCED, "parallel_tool_calls": False, "max_output_tokens": 60}
    first = create(client, ASK, **forced)
    call = _call(first)
    with client.responses.stream(model="m", input=ASK, temperature=0, **forced) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert _call(streamed).arguments == call.arguments
    # the client's usual second request: the first's output, then the call's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Rain, 9 C"}
    turns = [{"role": "user", "content": ASK}, *[item.model_dump() for item in first.output], result]
    second = create(client, turns, tools=TOOLS, max_output_tokens=8)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + 10  # the call and its result rendered
    chained = create(client, [result], tools=TOOLS, max_output_tokens=8, previous_response_id=first.id)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == second.usage.input_tokens
    assert chained.output_text == second.output_text
    # the client's token count of the same prompt, both ways
    count = client.responses.input_tokens.count
    assert count(model="m", input=turns, tools=TOOLS).input_tokens == second.usage.input_tokens
    assert count(model="m", input=[result], tools=TOOLS, previous_response_id=first.id).input_tokens == (
        second.usage.input_tokens
    )


# tool calls that end, with no max_tokens and the clients' default parallel calls: a named function
# is one call, `required` ends at the first repeated call (before this, minutes of the same call)
CHAT_TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": TOOLS[0]["description"], "parameters": WEATHER},
    }
]
CHAT_FORCED: Any = {"type": "function", "function": {"name": "get_weather"}}


def chat_calls(client: openai.OpenAI, tool_choice: Any, stream: bool) -> tuple[str | None, list[Any]]:
    """(finish_reason, [(name, arguments)]) of a greedy chat that must call a tool."""
    kwargs: Any = {"model": "m", "messages": [{"role": "user", "content": ASK}], "temperature": 0}
    kwargs.update(tools=CHAT_TOOLS, tool_choice=tool_choice)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, [(name, json.loads(arguments)) for name, arguments in calls]
    parts: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            part = parts.setdefault(call.index, ["", ""])
            part[0] += call.function.name or ""
            part[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return finish, [(name, json.loads(arguments)) for _, (name, arguments) in sorted(parts.items())]


def response_calls(client: openai.OpenAI, tool_choice: Any, stream: bool) -> tuple[str | None, list[Any]]:
    """(status, [(name, arguments)]) of a greedy response that must call a function."""
    kwargs: Any = {"model": "m", "input": ASK, "temperature": 0, "tools": TOOLS, "tool_choice": tool_choice}
    if stream:
        with client.responses.stream(**kwargs) as events:
            assert [event.type for event in events][-1] == "response.completed"
            reply = events.get_final_response()
    else:
        reply = client.responses.create(**kwargs)
    calls = [item for item in reply.output if item.type == "function_call"]
    return reply.status, [(call.name, json.loads(call.arguments)) for call in calls]


def check_turns_end(ask: Any, named: Any, required: Any, finished: str) -> None:
    """The named choice: exactly one call; required: distinct calls; each streamed or not alike,
    ended by a call (`finished`). The client's timeout bounds each request."""
    for stream in (False, True):
        finish, calls = ask(named, stream)
        assert finish == finished and [name for name, _ in calls] == ["get_weather"], (stream, calls)
    whole, streamed = ask(required, False), ask(required, True)
    assert whole == streamed
    finish, calls = whole
    assert finish == finished and calls, whole
    assert all(call not in calls[:i] for i, call in enumerate(calls)), calls  # no call repeated


def test_chat_tool_calls_end_one_named_call_and_no_repeated_required_call(client: openai.OpenAI) -> None:
    quick = client.with_options(timeout=60)
    check_turns_end(
        lambda choice, stream: chat_calls(quick, choice, stream), CHAT_FORCED, "required", "tool_calls"
    )


def test_function_calls_end_one_named_call_and_no_repeated_required_call(client: openai.OpenAI) -> None:
    quick = client.with_options(timeout=60)
    check_turns_end(
        lambda choice, stream: response_calls(quick, choice, stream), FORCED, "required", "completed"
    )


# The agent loop a client runs, in three turns: the user asks, the model calls the tool (the choice
# forces it: the bundled model is too small to decide), the client sends the result back and the
# model answers. Each turn is accepted and ends by itself, not at the token limit.
ANSWER_TOKENS = 256


def chat_turn(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str | None, Any]:
    """(finish_reason, the assistant message as the client sends it back) of one chat turn; a
    stream's deltas joined as a client joins them (content, then each call by its index)."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.finish_reason, choice.message.model_dump(exclude_none=True)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index not in calls and call.id and call.function, call  # each call whole, once
            calls[call.index] = call.model_dump(exclude_none=True, exclude={"index"})
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return finish, message


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_tool_loop_of_three_turns_ends_with_an_answer(client: openai.OpenAI, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": ASK}]
    kwargs: Any = {"model": "m", "temperature": 0, "tools": CHAT_TOOLS, "max_tokens": ANSWER_TOKENS}
    finish, called = chat_turn(client, stream, messages=messages, tool_choice=CHAT_FORCED, **kwargs)
    assert finish == "tool_calls" and not called.get("content"), called
    (call,) = called["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"]
    messages.append(called)
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Rain, 9 C"})
    finish, answer = chat_turn(client, stream, messages=messages, tool_choice="none", **kwargs)
    assert finish == "stop" and answer["content"] and "tool_calls" not in answer, answer


def response_turn(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    """One Response; streamed, it must end with response.completed (the helper's final response)."""
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        assert [event.type for event in events][-1] == "response.completed"
        return events.get_final_response()


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_tool_loop_of_three_turns_ends_with_an_answer(
    client: openai.OpenAI, stream: bool
) -> None:
    kwargs: Any = {"model": "m", "temperature": 0, "tools": TOOLS, "max_output_tokens": ANSWER_TOKENS}
    called = response_turn(client, stream, input=ASK, tool_choice=FORCED, **kwargs)
    assert called.status == "completed" and [item.type for item in called.output] == ["function_call"]
    call = _call(called)
    turns = [QUESTION, *[item.model_dump(exclude_none=True) for item in called.output]]
    turns.append({"type": "function_call_output", "call_id": call.call_id, "output": "Rain, 9 C"})
    answer = response_turn(client, stream, input=turns, tool_choice="none", **kwargs)
    assert answer.status == "completed" and answer.output_text, answer
    assert [item.type for item in answer.output] == ["message"]


def test_a_json_schema_format_is_followed(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}
    reply = create(client, ASK, text={"format": fmt}, max_output_tokens=40)
    forecast = json.loads(reply.output_text)
    assert forecast["city"] in ("Paris", "Rome", "Oslo") and forecast["days"] in (1, 2, 3)
    assert reply.text.format.type == "json_schema"


def test_stored_responses_are_read_and_deleted(client: openai.OpenAI) -> None:
    reply = create(client, max_output_tokens=4)
    assert client.responses.retrieve(reply.id).output_text == reply.output_text
    deleted = client.responses.with_raw_response.delete(reply.id).http_response.json()
    assert deleted == {"id": reply.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    unstored = create(client, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as caught:
        create(client, max_output_tokens=2, previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_the_store_evicts_the_oldest_beyond_its_size() -> None:
    store = ResponseStore(2)
    for name in ("a", "b", "c"):
        store.put({"id": name, "output": [{"type": "message"}]}, [{"role": "user"}])
    assert store.get("a") is None and len(store) == 2
    stored = store.get("c")
    assert stored is not None and stored.conversation == [{"role": "user"}, {"type": "message"}]
    empty = ResponseStore(0)
    empty.put({"id": "a", "output": []}, [])
    assert empty.get("a") is None


def refusal(client: openai.OpenAI, **kwargs: Any) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": "m", "input": STORY, "max_output_tokens": 4, **kwargs})
    body: Any = caught.value.body
    assert body["type"] == "invalid_request_error" and body["param"] in body["message"]
    return str(body["param"])


def test_bad_fields_are_400s_naming_them(client: openai.OpenAI) -> None:
    assert refusal(client, extra_body={"frobnicate": 1}) == "frobnicate"
    assert refusal(client, background=True) == "background"
    assert refusal(client, reasoning={"effort": "high"}) == "reasoning"
    assert refusal(client, include=["message.output_text.logprobs"]) == "include"
    assert refusal(client, truncation="auto") == "truncation"
    assert refusal(client, text={"format": {"type": "json_schema", "name": "x"}}) == "text"
    bad_strict = {
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": "yes"}
    }
    assert refusal(client, text=bad_strict) == "text"
    image = {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}
    assert refusal(client, input=[{"role": "user", "content": [image]}]) == "input[0].content[0]"
    assert refusal(client, tools=[{"type": "web_search"}]) == "tools"
    assert refusal(client, max_output_tokens=0) == "max_output_tokens"
    assert refusal(client, temperature=-1.0) == "temperature"
    assert refusal(client, extra_body={"top_k": -5}) == "top_k"  # SGLang's extensions are checked too
    assert create(client, max_output_tokens=2).usage.output_tokens == 2  # and the server goes on serving
    sglang = {"top_k": 1, "repetition_penalty": 1.0, "request_id": "r-responses-1"}
    assert create(client, max_output_tokens=2, extra_body=sglang).usage.output_tokens == 2


FUNCTION_CALL: Any = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
OUTPUT: Any = {"type": "function_call_output", "call_id": "call_1", "output": "Rain, 9 C"}
QUESTION: Any = {"role": "user", "content": ASK}
# (input, tools) OpenAI refuses, and the field its 400 names
INVALID_INPUTS: list[tuple[Any, Any, str]] = [
    ([QUESTION, OUTPUT], None, "input[1].call_id"),  # no call
    ([QUESTION, FUNCTION_CALL, {**OUTPUT, "call_id": "call_2"}], None, "input[2].call_id"),
    ([QUESTION, OUTPUT, FUNCTION_CALL], None, "input[1].call_id"),  # the call after its output
    ([QUESTION, FUNCTION_CALL, {"type": "function_call_output", "output": "x"}], None, "input[2].call_id"),
    ([{"role": "wizard", "content": "Abracadabra"}], None, "input[0].role"),
    ([{"role": ["user"], "content": "Hi"}], None, "input[0].role"),
    (STORY, [{"type": "function", "parameters": WEATHER}], "tools[0].name"),
    (STORY, [{"type": "function", "name": "get weather", "parameters": WEATHER}], "tools[0].name"),
]


def test_invalid_inputs_are_refused_naming_the_field(smollm2_dir: Path) -> None:
    """Function call outputs, roles and tool names as OpenAI checks them, under the Responses paths; a
    stored conversation (previous_response_id) supplies calls too."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tm: Any = SimpleNamespace(tokenizer=tokenizer, server_args=SimpleNamespace(tool_call_parser=None))
    for input, tools, path in INVALID_INPUTS:
        with pytest.raises(RequestError) as info:
            count_input_tokens(tm, {"input": input, "tools": tools}, [])
        assert info.value.param == path and path in str(info.value), (input, tools, str(info.value))
    assert count_input_tokens(tm, {"input": [QUESTION, FUNCTION_CALL, OUTPUT]}, [])
    assert count_input_tokens(tm, {"input": [OUTPUT]}, [QUESTION, FUNCTION_CALL])  # the stored call
    with pytest.raises(RequestError) as info:
        count_input_tokens(
            tm, {"input": [OUTPUT]}, [QUESTION, {"type": "message", "role": "assistant", "content": "Hi"}]
        )
    assert info.value.param == "input[0].call_id"


def test_invalid_inputs_get_openais_400_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    for input, tools, path in INVALID_INPUTS:
        assert refusal(client, input=input, **({"tools": tools} if tools else {})) == path
    stored = create(client, max_output_tokens=2)  # a stored response with no call: nothing to answer
    assert refusal(client, input=[OUTPUT], previous_response_id=stored.id) == "input[0].call_id"
    assert create(client, [QUESTION, FUNCTION_CALL, OUTPUT], max_output_tokens=2).usage.output_tokens == 2


def test_generated_conversations_get_a_reply_or_a_400_never_a_500(server: Server) -> None:
    """Valid and mutated conversations (tests/chat_conversations.py) sent to the three chat routes
    of the running server: each is answered 200 or 400 within the timeout, and the server stays
    healthy."""
    routes = {
        "openai": ("/v1/chat/completions", {"max_tokens": 1}),
        "anthropic": ("/v1/messages", {"max_tokens": 1}),
        "responses": ("/v1/responses", {"max_output_tokens": 1, "store": False}),
    }
    rng = random.Random(60)
    for case in range(30):
        for api, (route, limits) in routes.items():
            body = BUILDERS[api](rng, generated(rng))
            if rng.random() < 0.7:
                body = mutated(rng, body)
            reply = requests.post(server.url + route, json={"model": "m", **limits, **body}, timeout=30)
            assert reply.status_code in (200, 400), (case, api, body, reply.text)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_every_param_of_the_official_client_is_in_the_table() -> None:
    params = set(inspect.signature(Responses.create).parameters) - {
        "self",
        "extra_headers",
        "extra_query",
        "extra_body",
        "timeout",
    }
    assert params <= set(RESPONSES), params - set(RESPONSES)
    counted = set(inspect.signature(InputTokens.count).parameters) - {
        "self",
        "extra_headers",
        "extra_query",
        "extra_body",
        "timeout",
    }
    assert counted <= set(INPUT_TOKENS), counted - set(INPUT_TOKENS)


# ---- reasoning items, on made-up outputs ----
def _thinking_call() -> ResponsesCall:
    chat = ChatCall({}, True, {}, reasoning=ReasoningSplit("deepseek-r1"))
    return ResponsesCall(chat, [], echo_settings({"store": False}))


def test_reasoning_comes_first_as_its_own_item() -> None:
    reply = response(_thinking_call(), made_up_outputs(THINKING)[-1], "m", "resp_1", 0)
    assert [item["type"] for item in reply["output"]] == ["reasoning", "message"]
    assert reply["output"][0]["content"] == [{"type": "reasoning_text", "text": "Rain is likely"}]
    assert reply["output"][1]["content"][0]["text"] == "Take an umbrella."
    assert reply["status"] == "completed" and reply["usage"]["input_tokens_details"]["cached_tokens"] == 2
    parsed = openai.types.responses.Response.model_validate(reply)  # the client's own type reads it
    assert parsed.output_text == "Take an umbrella."


async def _events(texts: list[str], abort: bool = False) -> list[dict[str, Any]]:
    async def outputs() -> AsyncGenerator[dict[str, Any], None]:
        for out in made_up_outputs(texts):
            if abort and out["meta_info"]["finish_reason"] is not None:
                out["meta_info"]["finish_reason"] = {
                    "type": "abort",
                    "message": "aborted",
                    "status_code": 500,
                }
            yield out

    events = []
    async for part in stream_events(_thinking_call(), outputs(), "m", ResponseStore(1)):
        kind, data = part.decode().strip().split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert kind == "event: " + events[-1]["type"]
    return events


def test_a_stream_reasons_then_writes() -> None:
    events = asyncio.run(_events(THINKING))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    added = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "reasoning"), (1, "message")]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert reasoning == "Rain is likely" and text == "Take an umbrella."
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1] and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta"
    )
    final = events[-1]["response"]
    assert [item["content"][0]["text"] for item in final["output"]] == ["Rain is likely", "Take an umbrella."]


def test_an_aborted_stream_ends_with_an_error_event() -> None:
    events = asyncio.run(_events(THINKING, abort=True))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "error"
    assert "response.completed" not in kinds and "aborted" in events[-1]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
