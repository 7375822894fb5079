"""OpenAI chat `messages` -> Conversation, checked as OpenAI checks them: the six roles
(`developer` is a system turn, the legacy `function` a tool result named by its function), text
and refusal content parts (image, audio and file parts refused by name), an assistant's
`tool_calls`, and each `tool` message's `tool_call_id` answering an earlier call; `tools` and
`tool_choice` as typed values."""

from __future__ import annotations

from typing import Any

from srt.conversation.check import validated
from srt.conversation.model import Conversation, Message, Role, Tool, ToolCall
from srt.conversation.read import PartTypes, arguments_of, role_of, tool_of, tools_of
from srt.generate_parse import RequestError
from srt.tool_calls import NamedTool, ToolChoice

ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}
PARTS = PartTypes({"text": "text", "refusal": "refusal"}, refused=("image_url", "input_audio", "file"))


def conversation(messages: Any) -> Conversation:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    return validated((_message(m, f"messages[{i}]") for i, m in enumerate(messages)), "tool call")


def _message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with a role", where)
    wire_role = message.get("role")
    role = role_of(wire_role, ROLES, f"{where}.role")
    content = message.get("content")
    if content is None and role != "assistant":  # an assistant turn may carry only tool calls
        raise RequestError(f"{where}.content is required for a {wire_role} message", f"{where}.content")
    parts = PARTS.parts(content, f"{where}.content") if content is not None else ()
    name = message.get("name") if isinstance(message.get("name"), str) else None
    if role == "tool":
        path = None if wire_role == "function" else f"{where}.tool_call_id"
        return Message.tool_result(parts, message.get("tool_call_id"), path, name)
    calls = _calls(message.get("tool_calls"), where) if role == "assistant" else ()
    return Message(role, parts, calls, name=name)


def _calls(calls: Any, where: str) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list of function calls", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise RequestError(f"{at} must be an object with id, type and function", at)
        function = call.get("function")
        if not isinstance(function, dict):
            raise RequestError(
                f"{at}.function is required (an object with name and arguments)", f"{at}.function"
            )
        if not isinstance(call.get("id"), str):
            raise RequestError(f"{at}.id is required (a string)", f"{at}.id")
        if not isinstance(function.get("name"), str):
            raise RequestError(f"{at}.function.name is required (a string)", f"{at}.function.name")
        arguments = function.get("arguments")
        if not isinstance(arguments, (str, dict)):
            raise RequestError(f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments")
        out.append(ToolCall(call["id"], function["name"], arguments_of(arguments)))
    return tuple(out)


def tools(value: Any) -> tuple[Tool, ...]:
    """`tools`, each a function tool checked under its path."""
    return tools_of(value, _tool)


def _tool(tool: Any, path: str) -> Tool:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise RequestError(f"{path} must be {{'type': 'function', 'function': {{...}}}}", path)
    return tool_of(tool["function"], f"{path}.function.")


def tool_choice(value: Any) -> ToolChoice:
    """`tool_choice`: none, auto (the default), required, or {type: function, function: {name}}."""
    if value is None:
        return "auto"
    if isinstance(value, dict):
        function = value.get("function") if value.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise RequestError(
                "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        return NamedTool(name)
    if value not in ("none", "auto", "required"):
        raise RequestError(
            f"tool_choice must be none, auto, required or a named function, got {value!r}", "tool_choice"
        )
    return value
