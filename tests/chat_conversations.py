"""Generated chat conversations for the chat APIs' tests, seeded: an API-neutral conversation
written in OpenAI chat, Anthropic Messages and Responses words, and random mutations of a body."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

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


BUILDERS = {"openai": openai_body, "anthropic": anthropic_body, "responses": responses_body}


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
