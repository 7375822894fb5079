"""Anthropic Messages `system` + `messages` -> Conversation, checked as Anthropic checks them:
user and assistant turns (the system prompt is `system`), text blocks (image and document blocks
refused by name), an assistant's `tool_use` blocks its tool calls (thinking blocks dropped, as
Anthropic drops earlier turns' thinking), a user's `tool_result` blocks tool results before its
text, each answering an earlier `tool_use` by its `tool_use_id`."""

from __future__ import annotations

from typing import Any

from srt.conversation.check import validated
from srt.conversation.model import Conversation, Message, Part, Role, TextPart, ToolCall
from srt.conversation.read import PartTypes, role_of
from srt.generate_parse import RequestError

ROLES: dict[str, Role] = {"user": "user", "assistant": "assistant"}
_TEXT = {"text": "text"}
_MEDIA = ("image", "document", "search_result", "container_upload")
TEXT_BLOCKS = PartTypes(_TEXT, _MEDIA, noun="blocks")  # a system prompt, a tool result
USER_BLOCKS = PartTypes(_TEXT, _MEDIA, ("tool_result",), "blocks")
ASSISTANT_BLOCKS = PartTypes(_TEXT, _MEDIA, ("tool_use", "thinking", "redacted_thinking"), "blocks")


def conversation(system: Any, messages: Any) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out: list[Message] = []
    if system is not None:
        out.append(Message("system", TEXT_BLOCKS.parts(system, "system")))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with a role", where)
        hint = " (the system prompt is `system`)"
        role = role_of(message.get("role"), ROLES, f"{where}.role", hint)
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise RequestError(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        if role == "user":
            out.extend(_user(content, where))
        else:
            out.append(_assistant(content, where))
    return validated(out, "tool_use block")


def _user(content: str | list[Any], where: str) -> list[Message]:
    """A user message: its tool_result blocks as tool results, then its text as a user turn."""
    if isinstance(content, str):
        return [Message("user", USER_BLOCKS.parts(content, f"{where}.content"))]
    turns, parts = [], list[Part]()
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = USER_BLOCKS.kind(block, at)
        if kind == "tool_result":
            result = TEXT_BLOCKS.parts(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):
                result = (TextPart("Error: "), *result)
            turns.append(Message.tool_result(result, block.get("tool_use_id"), f"{at}.tool_use_id"))
        else:
            parts.append(USER_BLOCKS.part(block, kind, at))
    if parts or not turns:
        turns.append(Message("user", tuple(p for p in parts if p.text)))
    return turns


def _assistant(content: str | list[Any], where: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", ASSISTANT_BLOCKS.parts(content, f"{where}.content"))
    parts, calls = list[Part](), list[ToolCall]()
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = ASSISTANT_BLOCKS.kind(block, at)
        if kind == "tool_use":
            for key in ("id", "name"):
                if not isinstance(block.get(key), str):
                    raise RequestError(f"{at}.{key} is required (a string)", f"{at}.{key}")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise RequestError(f"{at}.input must be an object", f"{at}.input")
            calls.append(ToolCall(block["id"], block["name"], arguments))
        elif kind == "text":
            parts.append(ASSISTANT_BLOCKS.part(block, kind, at))
    return Message("assistant", tuple(p for p in parts if p.text), tuple(calls))
