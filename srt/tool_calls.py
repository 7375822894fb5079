"""Tool calls on /v1/chat/completions: `tools` and `tool_choice` validated, the grammar that makes
`required` and a named function always parse, and the model's text parsed back into `tool_calls`.

As SGLang: the tools are rendered by the model's chat template (or by srt's generic prompt where
the template renders none, srt/tool_template.py); `tool_choice` "required" or a named function
constrains the output to a JSON array of {"name", "parameters"} objects (SGLang's
`get_json_schema_constraint`; one call for a named function or without parallel_tool_calls), parsed
as such, a call identical to an earlier one ending the turn (srt/repeated_calls.py); "auto" parses
the format the template asks for, or the one `--tool-call-parser` names: `qwen25` (SGLang's name:
`<tool_call>{...}</tool_call>` blocks, Qwen 2.5 and 3), `llama3` (SGLang's: `<|python_tag|>` and/or
JSON objects with "name" and "parameters", separated by ";") or srt's `generic` (llama.cpp's idea:
the constrained array, after any text, its calls naming the request's functions). "none" renders
the tools but parses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from srt.detokenizer import stop_holdback_start
from srt.generate_parse import RequestError
from srt.server_args import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class NamedTool:
    """A tool choice naming the one function to call."""

    name: str


# what a request lets the model do with its tools, whichever API spelled it
ToolChoice = Literal["auto", "none", "required"] | NamedTool


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote; each API's adapter gives it an id of its own spelling."""

    name: str
    arguments: str  # a JSON object, serialized

    @property
    def parsed_arguments(self) -> Any:
        return _parsed(self.arguments)


@dataclass
class ToolPlan:
    """What a chat request does with its tools."""

    tools: list[dict[str, Any]]  # the request's, as the chat template gets them
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True
    parser: str | None = None  # for "auto": --tool-call-parser, or the template's
    names: list[str] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def ends_at_repeat(self) -> bool:
        """Whether the output is watched for a repeated call: `required` with parallel calls, the
        one grammar that lets several calls come (a greedy small model repeats its call until the
        token limit)."""
        return self.choice == "required" and self.parallel

    @property
    def parses(self) -> bool:
        return self.constrained or (self.choice == "auto" and self.parser is not None)

    def json_schema(self) -> str | None:
        """The grammar for required / a named function: a JSON array of calls, closable after each
        complete call (exactly one for a named function or without parallel_tool_calls)."""
        if not self.constrained:
            return None
        items = [
            _call_schema(t)
            for t in self.tools
            if self.choice == "required" or t["function"]["name"] == self.function
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": items[0] if len(items) == 1 else {"anyOf": items},
        }
        if not self.parallel or self.choice == "function":
            schema["maxItems"] = 1
        return json.dumps(schema)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; the text as content when it holds no call."""
        if self.constrained:
            return _parse_array(text)
        if self.parser == "qwen25":
            return _parse_qwen25(text)
        if self.parser == "llama3":
            return _parse_llama3(text)
        if self.parser == "generic":
            return _parse_generic(text, self.names)
        return text, []

    def complete_calls(self, text: str) -> list[ToolCall]:
        """The calls of a partial output that can no longer change: they stream before the output
        ends, and are always the first of the finished output's calls."""
        if self.constrained:
            return _array_items(text)
        if self.parser == "qwen25":
            start = text.find("<tool_call>")
            if start < 0:
                return []
            return [
                c
                for c in (_one_call(m.group(1)) for m in _QWEN_CLOSED_CALL.finditer(text, start))
                if c is not None
            ]
        if self.parser == "generic":
            return _generic_calls(text, self.names)[1]
        return []  # llama3: a call ends where the output does, or at a ";" the grammar does not promise

    def repeat_start(self, text: str) -> int | None:
        """Where a constrained output's calls stop being new: the end of the last complete call
        before the first one identical (same name, same parsed arguments) to an earlier one; None
        while no complete call repeats."""
        if not self.constrained:
            return None
        seen: list[tuple[str, Any]] = []
        end_of_new = 0
        for call, end in _array_spans(text):
            key = (call.name, call.parsed_arguments)
            if key in seen:
                return end_of_new
            seen.append(key)
            end_of_new = end
        return None

    def stream_safe_prefix(self, text: str) -> int:
        """How much of a partial output may stream as content: all of it until a call could have
        begun (the constrained array is never content)."""
        if self.constrained:
            return 0
        if self.parser is None or not self.parses:
            return len(text)
        cut = stop_holdback_start(text, 0, _CALL_STARTS[self.parser])  # before a call could begin
        if self.parser != "qwen25" and text[:cut].strip() == "" and cut < len(text):
            return 0
        return cut


_CALL_STARTS = {"qwen25": ["<tool_call>"], "llama3": ["<|python_tag|>", "{"], "generic": ["["]}
assert set(_CALL_STARTS) == set(TOOL_CALL_PARSERS)


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [function["name"]]},
            "parameters": function.get("parameters") or {"type": "object"},
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _parsed(arguments: str) -> Any:
    """A call's arguments as JSON values (two serializations of one object compare equal)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _array_call(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    return ToolCall(item["name"], _arguments(item.get("parameters", item.get("arguments", {}))))


def _array_items(text: str) -> list[ToolCall]:
    """The calls whose objects are complete in a (perhaps partial) JSON array of calls."""
    return [call for call, _ in _array_spans(text)]


def _array_spans(text: str) -> list[tuple[ToolCall, int]]:
    """The complete calls of a (perhaps partial) JSON array of calls, each with where its object ends."""
    decoder, calls = json.JSONDecoder(), list[tuple[ToolCall, int]]()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\n\r":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return calls
        call = _array_call(item)
        if call is not None:
            calls.append((call, at))
        while at < len(text) and text[at] in " \t\n\r":
            at += 1
        if not text.startswith(",", at):
            return calls
        at += 1


def _parse_array(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:  # cut short by max_tokens: the calls that were complete
        complete = _array_items(text)
        return (None, complete) if complete else (text, [])
    if not isinstance(calls, list):
        return text, []
    return None, [c for c in map(_array_call, calls) if c is not None]


_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_QWEN_CLOSED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _one_call(raw: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ToolCall(obj["name"], _arguments(obj.get("arguments", obj.get("parameters", {}))))


def _parse_qwen25(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = [c for c in (_one_call(m.group(1)) for m in _QWEN_CALL.finditer(text, start)) if c is not None]
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.replace("<|python_tag|>", "")
    start = body.find("{")
    if start < 0:
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], start
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            break
        call = _one_call(json.dumps(obj))
        if call is None:
            break
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    if not calls:
        return text, []
    content = body[:start].strip()
    return content or None, calls


_GENERIC_START = re.compile(r"\[\s*\{")


def _generic_calls(text: str, names: list[str]) -> tuple[int, list[ToolCall]]:
    """Where the first array of objects begins in (perhaps partial) text (-1: none), and its complete
    calls that name one of the functions."""
    found = _GENERIC_START.search(text)
    if found is None:
        return -1, []
    return found.start(), [c for c in _array_items(text[found.start() :]) if c.name in names]


def _parse_generic(text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
    start, calls = _generic_calls(text, names)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def plan_tools(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool, parser: str | None
) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); `tools` as the chat template takes them, each
    checked by its API's adapter. RequestError naming tools or tool_choice."""
    if not tools:
        if choice not in ("none", "auto"):
            raise RequestError("tool_choice needs tools", "tool_choice")
        return None
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools holds two functions of the same name", "tools")
    function = None
    if isinstance(choice, NamedTool):
        if choice.name not in names:
            raise RequestError(f"tool_choice names {choice.name!r}, which is not in tools", "tool_choice")
        kind, function = "function", choice.name
    else:
        kind = choice
    if kind == "auto" and parser is None:
        raise RequestError(
            "tool_choice auto: srt does not know the call format of this chat template; start the "
            f"server with --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}) or use required or a named function",
            "tool_choice",
        )
    return ToolPlan(tools, kind, function, parallel, parser, names)
