"""The three chat APIs' parsing on generated conversations, in-process (no server), seeded.

Valid conversations (a system prompt, user turns of text parts, assistant turns of text and tool
calls, tool results answering earlier calls) are written in each API's words, OpenAI chat,
Anthropic Messages and Responses (with the same tools, or none), and must parse to the same typed
Conversation and render to the same prompt tokens. Mutated ones (a random role, an id dropped or unknown, a tool result before its
call, a bad part type, odd nesting) must parse or raise RequestError naming a field path that is
in the request; never another exception."""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from srt.anthropic_parse import chat_body, count_tokens
from srt.conversation import Conversation, openai_chat
from srt.generate_parse import RequestError
from srt.openai_parse import chat_prompt
from srt.responses_parse import count_input_tokens

WORDS = ("rain", "Oslo", "tomorrow", "umbrella", "é", "日本", "{", "}", "<tool_call>", "[", '"', "\\n")
NAMES = ("get_weather", "set_alarm", "lookup")


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))


def generated(rng: random.Random) -> list[dict[str, Any]]:
    """An API-neutral conversation: turns of kind system / user / assistant / results, in an order
    every API can express (a system prompt first, no two assistant turns in a row, tool results
    after the calls they answer)."""
    turns: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        turns.append({"kind": "system", "texts": [text(rng) for _ in range(rng.randint(1, 2))]})
    turns.append({"kind": "user", "texts": [text(rng) for _ in range(rng.randint(1, 3))]})
    next_id = 0
    for _ in range(rng.randint(0, 4)):
        calls = []
        for _ in range(rng.choice((0, 1, 1, 2))):
            calls.append(
                {"id": f"id_{next_id}", "name": rng.choice(NAMES), "arguments": {"n": rng.randint(0, 9)}}
            )
            next_id += 1
        texts = [text(rng) for _ in range(rng.choice((0, 1, 2) if calls else (1, 2)))]
        turns.append({"kind": "assistant", "texts": texts, "calls": calls})
        if calls:
            answered = rng.sample(calls, rng.randint(1, len(calls)))
            turns.append({"kind": "results", "results": [(c["id"], text(rng)) for c in answered]})
        if not calls or rng.random() < 0.5:
            turns.append({"kind": "user", "texts": [text(rng) for _ in range(rng.randint(1, 2))]})
    return turns


def parts(rng: random.Random, texts: list[str], kind: str) -> Any:
    if len(texts) == 1 and rng.random() < 0.5:
        return texts[0]
    return [{"type": kind, "text": t} for t in texts]


def openai_body(rng: random.Random, turns: list[dict[str, Any]]) -> dict[str, Any]:
    messages: list[Any] = []
    for turn in turns:
        if turn["kind"] in ("system", "user"):
            role = rng.choice(("system", "developer")) if turn["kind"] == "system" else "user"
            messages.append({"role": role, "content": parts(rng, turn["texts"], "text")})
        elif turn["kind"] == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": None}
            if turn["texts"]:
                message["content"] = parts(rng, turn["texts"], "text")
            if turn["calls"]:
                message["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                    }
                    for c in turn["calls"]
                ]
            messages.append(message)
        else:
            messages.extend({"role": "tool", "tool_call_id": i, "content": t} for i, t in turn["results"])
    return {"messages": messages}


def anthropic_body(rng: random.Random, turns: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": []}
    for turn in turns:
        if turn["kind"] == "system":
            body["system"] = parts(rng, turn["texts"], "text")
        elif turn["kind"] == "user":
            body["messages"].append({"role": "user", "content": parts(rng, turn["texts"], "text")})
        elif turn["kind"] == "assistant":
            blocks = [{"type": "text", "text": t} for t in turn["texts"]]
            blocks += [
                {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
                for c in turn["calls"]
            ]
            body["messages"].append({"role": "assistant", "content": blocks})
        else:
            results = [{"type": "tool_result", "tool_use_id": i, "content": t} for i, t in turn["results"]]
            body["messages"].append({"role": "user", "content": results})
    return body


def responses_body(rng: random.Random, turns: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"input": []}
    for turn in turns:
        if turn["kind"] == "system" and len(turn["texts"]) == 1 and rng.random() < 0.5:
            body["instructions"] = turn["texts"][0]
        elif turn["kind"] in ("system", "user"):
            role = rng.choice(("system", "developer")) if turn["kind"] == "system" else "user"
            content = parts(rng, turn["texts"], "input_text")
            body["input"].append({"type": "message", "role": role, "content": content})
        elif turn["kind"] == "assistant":
            if turn["texts"]:
                content = [{"type": "output_text", "text": t} for t in turn["texts"]]
                body["input"].append({"role": "assistant", "content": content})
            body["input"].extend(
                {
                    "type": "function_call",
                    "call_id": c["id"],
                    "name": c["name"],
                    "arguments": json.dumps(c["arguments"]),
                }
                for c in turn["calls"]
            )
        else:
            body["input"].extend(
                {"type": "function_call_output", "call_id": i, "output": t} for i, t in turn["results"]
            )
    return body


@pytest.fixture(scope="module")
def tm(smollm2_dir: Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return SimpleNamespace(tokenizer=tokenizer, server_args=SimpleNamespace(tool_call_parser=None))


def prompts(tm: Any, api: str, body: dict[str, Any]) -> list[int] | int:
    """The request's prompt (or its token count), through the API's own parser."""
    if api == "openai":
        return chat_prompt(tm, body).input_ids
    if api == "anthropic":
        return count_tokens(tm, body)
    return count_input_tokens(tm, body, [])


def conversation_of(api: str, body: dict[str, Any]) -> Conversation:
    if api == "openai":
        return openai_chat.conversation(body["messages"])
    if api == "anthropic":
        return chat_body(body)[1]
    from srt.conversation import responses_input

    return responses_input.conversation(body.get("instructions"), body["input"], 0)


BUILDERS = {"openai": openai_body, "anthropic": anthropic_body, "responses": responses_body}


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def with_tools(bodies: dict[str, dict[str, Any]], names: list[str]) -> None:
    """The same function tools, in each API's words."""
    functions = [{"name": name, "description": f"Does {name}", "parameters": SCHEMA} for name in names]
    bodies["openai"]["tools"] = [{"type": "function", "function": f} for f in functions]
    bodies["responses"]["tools"] = [{"type": "function", **f} for f in functions]
    bodies["anthropic"]["tools"] = [
        {"name": f["name"], "description": f["description"], "input_schema": SCHEMA} for f in functions
    ]


def test_a_valid_conversation_is_the_same_typed_conversation_and_prompt_through_every_api(tm: Any) -> None:
    rng = random.Random(60)
    for case in range(150):
        turns = generated(rng)
        bodies = {api: build(rng, turns) for api, build in BUILDERS.items()}
        if rng.random() < 0.5:  # the prompt then holds srt's generic tools prompt
            with_tools(bodies, rng.sample(NAMES, rng.randint(1, len(NAMES))))
        typed = {api: conversation_of(api, body) for api, body in bodies.items()}
        assert typed["openai"] == typed["anthropic"] == typed["responses"], (case, bodies)
        ids = prompts(tm, "openai", bodies["openai"])
        assert isinstance(ids, list)
        counts = {
            len(ids),
            prompts(tm, "anthropic", bodies["anthropic"]),
            prompts(tm, "responses", bodies["responses"]),
        }
        assert len(counts) == 1, (case, bodies, counts)


JUNK: tuple[Any, ...] = (None, 3, -1.5, True, "wizard", "", [], {}, ["user"], {"type": "text"}, [[{}]])


def places(value: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, container, key) of every value in a JSON tree."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        out.append((where, value, key))
        out.extend(places(child, where))
    return out


def mutated(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    """body with one to three random changes: a value replaced by junk or an odd nesting, a key
    dropped, an id made unknown, two messages swapped."""
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        spots = places(body)
        if not spots:
            break
        path, container, key = rng.choice(spots)
        action = rng.random()
        if action < 0.4:
            container[key] = rng.choice(JUNK)
        elif action < 0.55 and isinstance(container, dict):
            del container[key]
        elif action < 0.7:
            container[key] = rng.choice(
                ([container[key]], {"type": "text", "text": container[key]}, {"x": container[key]})
            )
        elif action < 0.85 and isinstance(container[key], str):
            container[key] = container[key] + "_unknown"
        else:
            for messages in (body.get("messages"), body.get("input")):
                if isinstance(messages, list) and len(messages) > 1:
                    i, j = rng.sample(range(len(messages)), 2)
                    messages[i], messages[j] = messages[j], messages[i]
    return body


PATH_PART = re.compile(r"([A-Za-z_]+)|\[(-?\d+)\]|\.([A-Za-z_]+)")


def in_request(body: dict[str, Any], path: str) -> bool:
    """Whether `path` names a field of body: every step but the last exists, and the last is a key
    of an object (a field that may be missing) or an index that exists."""
    steps = [m.group(1) or m.group(3) or int(m.group(2)) for m in PATH_PART.finditer(path)]
    if "".join(m.group(0) for m in PATH_PART.finditer(path)) != path or not steps:
        return False
    value: Any = body
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        if isinstance(step, int):
            if not isinstance(value, list) or not -len(value) <= step < len(value):
                return False
        elif not isinstance(value, dict) or (step not in value and not last):
            return False
        if last:
            return True
        value = value[step]
    return True


@pytest.mark.parametrize("api", list(BUILDERS))
def test_an_invalid_conversation_is_a_request_error_naming_a_field_of_the_request(tm: Any, api: str) -> None:
    rng = random.Random(f"issue-60-{api}")
    refused = 0
    for case in range(300):
        body = mutated(rng, BUILDERS[api](rng, generated(rng)))
        try:
            prompts(tm, api, body)
        except RequestError as error:
            refused += 1
            assert error.param is not None and in_request(body, error.param), (
                case,
                error.param,
                str(error),
                body,
            )
            assert error.param in str(error) or error.param in ("messages", "input", "system"), (
                case,
                str(error),
            )
    assert refused > 150, refused  # most mutations break the conversation
