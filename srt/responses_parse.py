"""OpenAI Responses bodies -> chat calls (ResponsesCall), validated: a bad or unsupported field
raises RequestError naming it, under the Responses name.

The conversation (`instructions`, then the items of `input`, a string being one user message) is
read into the typed Conversation by srt/conversation/responses_input.py; `previous_response_id` puts
the stored conversation's items before them (responses_store.py). The rest becomes the typed
ChatRequest: function tools its tools, `tool_choice` the typed choice, `text.format` a grammar,
`max_output_tokens` its token limit; conversation/call.py's chat_call makes the generate call of it,
as of every API's request. OpenAI's hosted tools (web_search, file_search, code_interpreter, mcp,
...) are refused by name.

The fields, from the official client's `responses.create` (openai 3.60) and SGLang's
`ResponsesRequest` (sglang 0.5.23: its sampling and scheduling extensions, as its chat
completions take them), in the kinds of srt/request_fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from srt.conversation import Tool, responses_input
from srt.conversation.call import ChatCall, chat_call
from srt.conversation.read import template_kwargs, tool_of, tools_of
from srt.conversation.render import render_prompt
from srt.conversation.request import ChatRequest, NamedTool, ToolChoice
from srt.generate_parse import RequestError, check_request_fields
from srt.request_fields import CHAT, NONE, Field, advisory, impl, off

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager

SOURCES = "openai 3.60, sglang 0.5.23"

_SGLANG_CHAT_FIELDS = (
    "chat_template_kwargs",
    "priority",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "session_id",
    "extra_key",
    "cache_salt",
    "data_parallel_rank",
)
RESPONSES: dict[str, Field] = {
    "model": advisory(),  # any name is served; replies name the served model
    "input": impl(),
    "instructions": impl(),
    "tools": impl(),
    "tool_choice": impl("auto"),
    "parallel_tool_calls": impl(True),
    "text": impl(),  # format: text, json_object, json_schema; verbosity only at medium
    "max_output_tokens": impl(),
    "temperature": impl(1.0),
    "top_p": impl(1.0),
    "stream": impl(False),
    "store": impl(True),  # kept in the front end's memory, bounded by --responses-store-size
    "previous_response_id": impl(),
    "metadata": advisory(),  # labels, echoed in the response
    "user": advisory(),
    "safety_identifier": advisory(),
    "prompt_cache_key": advisory(),  # srt's radix cache reuses every prompt's prefix anyway
    "prompt_cache_retention": advisory(),
    "prompt_cache_options": advisory(),
    "service_tier": advisory(),
    "stream_options": off(None, {"include_obfuscation": False}),  # srt pads no deltas
    "include": off(None, []),  # srt produces none of the extra outputs it asks for
    "background": off(False),
    "truncation": off("disabled"),
    "top_logprobs": off(0),
    "reasoning": NONE,  # effort and summaries: the model thinks as its template says
    "max_tool_calls": NONE,
    "prompt": NONE,  # stored prompt templates live on OpenAI's side
    "conversation": NONE,
    "context_management": NONE,
    "background_options": NONE,
    "access_programs": NONE,
    "image": NONE,
    "moderation": NONE,
    # SGLang's extensions: as in its chat completions (srt/request_fields.py's CHAT)
    **{name: CHAT[name] for name in _SGLANG_CHAT_FIELDS},
    "request_id": impl(),  # the chat's rid
}

# POST /v1/responses/input_tokens: the official client's `responses.input_tokens.count` params
INPUT_TOKENS: dict[str, Field] = {
    **{name: RESPONSES[name] for name in ("model", "input", "instructions", "tools", "tool_choice")},
    **{name: RESPONSES[name] for name in ("parallel_tool_calls", "text", "previous_response_id")},
    **{name: RESPONSES[name] for name in ("reasoning", "truncation", "conversation")},
    "personality": NONE,
}

# /generate's parameters -> the Responses field the client set
NAMES = {
    "input_ids": "input",
    "max_new_tokens": "max_output_tokens",
    "json_schema": "text",
    "rid": "request_id",
}
# SGLang's sampling extensions, by /generate's names
_SAMPLING = ("frequency_penalty", "presence_penalty", "stop", "top_k", "min_p", "repetition_penalty")


@dataclass
class ResponsesCall:
    """One Responses request: its generate call, the conversation it continues (its items, for
    the store) and the settings its response echoes."""

    chat: ChatCall
    items: list[dict[str, Any]]  # the stored conversation before it, then this request's input
    echo: dict[str, Any]


def _input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise RequestError("input must be a string or a list of items", "input")
    return value


def _tool(tool: Any, path: str) -> Tool:
    """A function tool, checked under its Responses path."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise RequestError(f"{path}: {kind!r} tools are not supported by srt (only function tools)", "tools")
    return tool_of(tool, f"{path}.")


def _tool_choice(choice: Any) -> ToolChoice:
    if choice is None:
        return "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedTool(choice["name"])
    if choice in ("auto", "required", "none"):
        return choice
    raise RequestError(
        f"tool_choice must be auto, required, none or {{type: function, name}}, got {choice!r}", "tool_choice"
    )


def _format(body: dict[str, Any]) -> dict[str, Any]:
    """text.format as /generate's grammar."""
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise RequestError("text must be an object with format (and verbosity)", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError(f"text.verbosity={text['verbosity']!r} is not supported by srt", "text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema is required (a JSON schema object)", "text")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
            raise RequestError(f"text.format.strict must be a boolean, got {fmt['strict']!r}", "text")
        return {"json_schema": orjson.dumps(fmt["schema"]).decode()}  # strict or not: srt constrains
    raise RequestError("text.format.type must be text, json_object or json_schema", "text")


def _max_output_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_output_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise RequestError(
            f"max_output_tokens must be a positive integer, got {value!r}", "max_output_tokens"
        )
    return value


def echo_settings(body: dict[str, Any]) -> dict[str, Any]:
    """The settings a Response repeats (OpenAI's defaults where the request left them out)."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "text": {"format": fmt},
        "metadata": body.get("metadata") or {},
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store") is not False,
        "user": body.get("user"),
        "truncation": "disabled",
        "reasoning": None,
        "background": False,
        "service_tier": "default",
    }


def chat_request(
    body: dict[str, Any], history: list[dict[str, Any]]
) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """(the typed request, its conversation's items) of a Responses body whose fields were checked."""
    for name in ("store", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be a boolean, got {body[name]!r}", name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string", "instructions")
    items = [*history, *_input_items(body)]
    sampling = {
        name: body[name] for name in ("temperature", "top_p", *_SAMPLING) if body.get(name) is not None
    }
    fields = {"rid": body.get("request_id"), "priority": body.get("priority")}
    request = ChatRequest(
        responses_input.conversation(instructions, items, len(history)),
        tools_of(body.get("tools"), _tool),
        _tool_choice(body.get("tool_choice")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        sampling={**sampling, **_format(body)},
        max_tokens=_max_output_tokens(body),
        stream=body.get("stream") or False,
        template_options=template_kwargs(body.get("chat_template_kwargs")),
        request_fields={name: value for name, value in fields.items() if value is not None},
        names=NAMES,
    )
    return request, items


def parse_responses(
    tm: TokenizerManager, body: dict[str, Any], history: list[dict[str, Any]]
) -> ResponsesCall:
    """The call of a Responses body that continues `history` (the stored conversation of its
    previous_response_id, else [])."""
    check_request_fields(body, RESPONSES)
    request, items = chat_request(body, history)
    return ResponsesCall(chat_call(tm, request, ChatCall), items, echo_settings(body))


def count_input_tokens(tm: TokenizerManager, body: dict[str, Any], history: list[dict[str, Any]]) -> int:
    """The tokens the prompt of a Responses body (after `history`) takes: its instructions, input
    items and tools through the chat template (POST /v1/responses/input_tokens)."""
    check_request_fields(body, INPUT_TOKENS)
    return len(render_prompt(tm, chat_request(body, history)[0]).input_ids)
