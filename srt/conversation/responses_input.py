"""Responses `instructions` + `input` items -> Conversation, checked as OpenAI checks them:
`instructions` a system turn first, message items turns of their role (`developer` a system turn)
of text parts (image, file and audio parts refused by name), `function_call` items the calls of
the assistant turn just before them (or of one of their own), `function_call_output` items tool
results answering a `function_call` before them; `reasoning` items are dropped, as the chat drops
earlier turns' reasoning. Items from the store (previous_response_id) come first, at negative
indices, so a path names the request's own items."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from srt.conversation.check import validated
from srt.conversation.model import Conversation, Message, Role, TextPart, ToolCall
from srt.conversation.read import PartTypes, arguments_of, role_of
from srt.generate_parse import RequestError

ROLES: dict[str, Role] = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
PARTS = PartTypes(
    {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"},
    refused=("input_image", "input_file", "input_audio"),
)


def conversation(instructions: str | None, items: list[dict[str, Any]], stored: int) -> Conversation:
    """The conversation of `items`, the first `stored` of them from the store."""
    out = [Message("system", (TextPart(instructions),))] if instructions else []
    for i, item in enumerate(items, start=-stored):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = role_of(item.get("role"), ROLES, f"{where}.role")
            out.append(Message(role, PARTS.parts(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            call = _call(item, where)
            if out and out[-1].role == "assistant":
                out[-1] = replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(Message("assistant", (), (call,)))
        elif kind == "function_call_output":
            output = PARTS.parts(item.get("output"), f"{where}.output")
            out.append(Message.tool_result(output, item.get("call_id"), f"{where}.call_id"))
        elif kind != "reasoning":
            raise RequestError(
                f"{where}.type: {kind!r} items are not supported (srt takes message, function_call, "
                "function_call_output and reasoning items)",
                f"{where}.type",
            )
    if not out:
        raise RequestError("input must hold a message", "input")
    return validated(out, "function_call item")


def _call(item: dict[str, Any], where: str) -> ToolCall:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise RequestError(f"{where}.{key} is required (a string)", f"{where}.{key}")
    return ToolCall(item["call_id"], item["name"], arguments_of(item["arguments"]))
