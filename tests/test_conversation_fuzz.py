"""The three chat APIs' parsing on generated conversations, in-process (no server), seeded.

Valid conversations (a system prompt, user turns of text parts, assistant turns of text and tool
calls, tool results answering earlier calls) are written in each API's words, OpenAI chat,
Anthropic Messages and Responses (with the same tools, or none), and must parse to the same typed
Conversation and render to the same prompt tokens. Mutated ones (a random role, an id dropped or unknown, a tool result before its
call, a bad part type, odd nesting) must parse or raise RequestError naming a field path that is
in the request; never another exception."""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from chat_conversations import BUILDERS, NAMES, generated, mutated
from transformers import AutoTokenizer

from srt.anthropic_parse import chat_request, count_tokens
from srt.conversation import Conversation, openai_chat
from srt.generate_parse import RequestError
from srt.openai_parse import chat_prompt
from srt.responses_parse import count_input_tokens


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
        return chat_request(body).conversation
    from srt.conversation import responses_input

    return responses_input.conversation(body.get("instructions"), body["input"], 0)


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
