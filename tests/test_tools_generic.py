"""Tools on a chat template that does not render them: SmolLM2's (the default model), served with
no flags, driven by the official `openai` client. The tools reach the prompt through srt's generic
tool prompt, tool_choice auto and required answer, and the client's usual round trip (a call, then
the assistant's tool_calls and a `tool` result sent back) completes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from chat_outputs import WEATHER
from server_fixture import Server

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": WEATHER,
        },
    }
]
MESSAGES: Any = [{"role": "user", "content": "Will it rain in Oslo tomorrow?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with Server("--dtype", "float32", "--max-total-tokens", "4096") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, messages: Any = MESSAGES, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kwargs)


def test_tools_reach_the_prompt_and_auto_answers(client: openai.OpenAI) -> None:
    plain = ask(client, max_tokens=1)
    auto = ask(client, tools=TOOLS, max_tokens=8)  # tool_choice auto, the default: no --tool-call-parser
    assert plain.usage is not None and auto.usage is not None
    # the functions' schemas and the call format are in the system message
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 60
    choice = auto.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_required_calls_a_function_and_the_round_trip_completes(client: openai.OpenAI) -> None:
    first = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in WEATHER["properties"]["city"]["enum"]  # type: ignore[index]
    # the client's usual second request: its call and the result sent back, the tools again (auto)
    messages = [*MESSAGES, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Rain, 9 C"}]
    second = ask(client, messages, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered
