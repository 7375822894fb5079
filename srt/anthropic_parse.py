"""Anthropic Messages bodies -> generate calls (ChatCall), validated: a bad or unsupported field
raises RequestError naming it, under Anthropic's name.

The conversation (`system`, `messages`) is read into the typed Conversation by
srt/conversation/anthropic_messages.py, the rest into the typed ChatRequest: `tools` its tools,
`tool_choice` auto / any / tool / none the typed choice (auto / required / a named tool / none),
`stop_sequences` stop strings, `thinking` the split of `--reasoning-parser`, `output_config`'s
format a JSON schema; conversation/call.py's chat_call makes the generate call of it (the chat
template, the tools prompt, the grammar of a forced call), as of every API's request.

The fields, from the official client's `messages.create` and `messages.count_tokens` (anthropic
2.17) and SGLang's `AnthropicMessagesRequest` (sglang 0.5.23), in the kinds of srt/request_fields.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from srt.conversation import Tool, anthropic_messages
from srt.conversation.call import ChatCall, chat_call
from srt.conversation.read import tool_of, tools_of
from srt.conversation.render import render_prompt
from srt.conversation.request import ChatRequest, NamedTool, ToolChoice
from srt.generate_parse import RequestError, check_request_fields
from srt.request_fields import NONE, Field, advisory, impl

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager

SOURCES = "anthropic 2.17, sglang 0.5.23"

_COMMON: dict[str, Field] = {
    "model": advisory(),  # any name is served; replies name the served model
    "messages": impl(),
    "system": impl(),
    "tools": impl(),
    "tool_choice": impl(),
    # with --reasoning-parser the <think> part is a thinking block; budget_tokens is a hint
    "thinking": impl(),
    "output_config": impl(),  # format (a JSON schema the output follows); effort and task_budget off
    "cache_control": advisory(),  # srt's radix cache reuses every prompt's prefix anyway
    "speed": advisory(),
    "user_profile_id": advisory(),
    "workspace_id": advisory(),
    "betas": advisory(),  # Claude Code sends them; no beta changes what srt returns
    "output_format": NONE,
}
MESSAGES: dict[str, Field] = {
    **_COMMON,
    "max_tokens": impl(),
    "stop_sequences": impl(),
    "stream": impl(False),
    "temperature": impl(1.0),
    "top_p": impl(),
    "top_k": impl(),
    "metadata": advisory(),  # user_id: a label
    "service_tier": advisory(),
    "inference_geo": advisory(),
    "diagnostics": advisory(),
    "container": NONE,
    "context_management": NONE,
    "mcp_servers": NONE,
}
COUNT_TOKENS: dict[str, Field] = dict(_COMMON)

# /generate's parameters -> the Messages field the client set
NAMES = {
    "input_ids": "messages",
    "max_new_tokens": "max_tokens",
    "stop": "stop_sequences",
    "json_schema": "output_config",
}
_TOOL_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}
_SERVER_TOOL_PREFIXES = (
    "web_search",
    "web_fetch",
    "bash",
    "text_editor",
    "computer",
    "code_execution",
    "memory",
)


def _tool(tool: Any, path: str) -> Tool:
    """A custom tool, checked under its Messages path."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
        raise RequestError(f"{path}: Anthropic's server tool {kind} is not supported by srt", "tools")
    if not isinstance(tool, dict) or kind not in (None, "custom"):
        raise RequestError(f"{path} must be a custom tool with a name and an input_schema", "tools")
    function = tool_of(tool, f"{path}.", "input_schema")
    if function.parameters is None:
        raise RequestError(f"{path}.input_schema is required (a JSON schema object)", f"{path}.input_schema")
    return function


def _tool_choice(choice: Any) -> tuple[ToolChoice, bool]:
    """(the typed tool choice, whether parallel calls are allowed) of tool_choice."""
    if choice is None:
        return "auto", True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice of type tool needs the tool's name", "tool_choice")
        typed: ToolChoice = NamedTool(choice["name"])
    elif kind in _TOOL_CHOICES:
        typed = _TOOL_CHOICES[kind]
    else:
        raise RequestError("tool_choice.type must be auto, any, tool or none", "tool_choice")
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None and not isinstance(serial, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    return typed, not serial


def _thinking(body: dict[str, Any]) -> bool:
    """Whether the <think> part is split off: thinking enabled or adaptive (or not sent), with
    --reasoning-parser; disabled: no split, and the chat template is asked not to think
    (enable_thinking, as Qwen3's)."""
    thinking = body.get("thinking")
    if thinking is None:
        return True
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "adaptive"):
        budget = thinking.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise RequestError(
                f"thinking.budget_tokens must be a positive integer, got {budget!r}", "thinking"
            )
        return True
    if kind == "disabled":
        return False
    raise RequestError("thinking.type must be enabled, adaptive or disabled", "thinking")


def _output_format(body: dict[str, Any]) -> dict[str, Any]:
    """output_config.format as /generate's json_schema."""
    config = body.get("output_config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise RequestError("output_config must be an object", "output_config")
    for name in sorted(set(config) - {"format"}):
        if config[name] is not None:
            raise RequestError(f"output_config.{name} is not supported by srt", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise RequestError("output_config.format must be {type: json_schema, schema: {...}}", "output_config")
    return {"json_schema": orjson.dumps(fmt["schema"]).decode()}


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """The typed request of a Messages (or count_tokens) body whose vocabulary was checked: its
    conversation, tools, tool choice, thinking and output format."""
    conversation = anthropic_messages.conversation(body.get("system"), body.get("messages"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    thinking = _thinking(body)
    return ChatRequest(
        conversation,
        tools_of(body.get("tools"), _tool),
        choice,
        parallel_tool_calls=parallel,
        sampling=_output_format(body),
        separate_reasoning=thinking,
        template_options={} if thinking else {"enable_thinking": False},
        names=NAMES,
    )


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """temperature, top_p and top_k in Anthropic's ranges, and stop_sequences, as /generate's."""
    out: dict[str, Any] = {}
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop_sequences must be a list of non-empty strings", "stop_sequences")
    if stops:
        out["stop"] = stops
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise RequestError(f"{name}: must be a number from {low:g} to {high:g} (got {value!r})", name)
        out[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise RequestError(f"top_k: must be an integer of 0 or more (got {top_k!r})", "top_k")
        out["top_k"] = top_k if top_k > 0 else -1  # 0: no top-k cut, as -1 is here
    return out


def parse_messages(tm: TokenizerManager, body: dict[str, Any]) -> ChatCall:
    check_request_fields(body, MESSAGES)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens is required, a positive integer (got {max_tokens!r})", "max_tokens")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}", "stream")
    request = chat_request(body)
    sampling = {**request.sampling, **_sampling(body)}
    request = replace(request, sampling=sampling, max_tokens=max_tokens, stream=stream)
    return chat_call(tm, request, ChatCall)


def count_tokens(tm: TokenizerManager, body: dict[str, Any]) -> int:
    """The tokens a Messages body's prompt takes (its system prompt, turns and tools)."""
    check_request_fields(body, COUNT_TOKENS)
    return len(render_prompt(tm, chat_request(body)).input_ids)
