"""Readers the API adapters share: a role by the API's table, content parts by the API's part
types, a call's arguments. Each raises RequestError naming the client's field path."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from srt.conversation.model import Part, Role, TextPart, Tool
from srt.generate_parse import RequestError


def role_of(value: Any, roles: Mapping[str, Role], path: str, hint: str = "") -> Role:
    """The typed role of an API's `role` field (`roles`: the API's names -> ours)."""
    if not isinstance(value, str) or value not in roles:
        raise RequestError(f"{path} must be one of {', '.join(roles)}{hint}, got {value!r}", path)
    return roles[value]


@dataclass(frozen=True)
class PartTypes:
    """An API's content part types: those srt reads as text (type -> the field holding it), those
    the API knows that srt refuses (media: srt serves text models), and those the adapter reads
    itself (tool blocks)."""

    text: Mapping[str, str]
    refused: tuple[str, ...] = ()
    structural: tuple[str, ...] = ()
    noun: str = "parts"

    def kind(self, part: Any, path: str) -> str:
        """A part's type, one the adapter reads; RequestError for any other."""
        if not isinstance(part, dict):
            raise RequestError(f"{path} must be an object with a type", path)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise RequestError(f"{path}.type is required (a string)", f"{path}.type")
        known = (*self.text, *self.structural, *self.refused)
        if kind not in known:
            raise RequestError(f"{path}.type must be one of {', '.join(known)}, got {kind!r}", f"{path}.type")
        if kind in self.refused:
            raise RequestError(f"{path}: {kind} {self.noun} are not supported (srt serves text models)", path)
        return kind

    def part(self, part: dict[str, Any], kind: str, path: str) -> Part:
        name = self.text[kind]
        if not isinstance(part.get(name), str):
            raise RequestError(f"{path}.{name} must be a string", f"{path}.{name}")
        return TextPart(part[name])

    def parts(self, content: Any, path: str) -> tuple[Part, ...]:
        """A content that is a string or a list of these parts (no structural ones), empty text left out."""
        if isinstance(content, str):
            return (TextPart(content),) if content else ()
        if not isinstance(content, list):
            raise RequestError(f"{path} must be a string or a list of {self.noun}", path)
        out = []
        for j, item in enumerate(content):
            where = f"{path}[{j}]"
            kind = self.kind(item, where)
            assert kind in self.text, "a content of structural parts is the adapter's to read"
            out.append(self.part(item, kind, where))
        return tuple(p for p in out if p.text)


def arguments_of(value: Any) -> Any:
    """A call's arguments decoded (OpenAI and Responses send them serialized; chat templates
    render an object); text that is not JSON as it is."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tool_of(function: dict[str, Any], path: str, parameters: str = "parameters") -> Tool:
    """A tool from its fields as an API spells them: `path` the prefix of their paths
    (`tools[0].function.`, `tools[0].`), `parameters` the name of its schema's field."""
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise RequestError(f"{path}name must be 1-64 letters, digits, _ . or -", f"{path}name")
    schema = function.get(parameters)
    if schema is not None and not isinstance(schema, dict):
        raise RequestError(f"{path}{parameters} must be a JSON schema object", f"{path}{parameters}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{path}description must be a string", f"{path}description")
    return Tool(name, schema, description)


def tools_of(value: Any, tool: Callable[[Any, str], Tool]) -> tuple[Tool, ...]:
    """An API's `tools` (None: none), each read by `tool(item, its path)`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RequestError("tools must be a list of tools", "tools")
    return tuple(tool(item, f"tools[{i}]") for i, item in enumerate(value))


# apply_chat_template arguments srt sets itself: chat_template_kwargs may not override them
_TEMPLATE_ARGS = {
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "tools",
    "documents",
    "return_dict",
    "return_assistant_tokens_mask",
}


def template_kwargs(value: Any) -> dict[str, Any]:
    """chat_template_kwargs (SGLang's): apply_chat_template's extra arguments, none srt sets itself."""
    extra = value or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(set(extra) & _TEMPLATE_ARGS)
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    return dict(extra)
