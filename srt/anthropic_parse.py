"""Anthropic Messages bodies -> chat calls (AnthropicCall), validated: a bad or unsupported field
raises RequestError naming it, under Anthropic's name.

The conversation (`system`, `messages`) is read into the typed Conversation by
srt/conversation/anthropic_messages.py. The rest is a chat request spelled differently: `tools`
function tools, `tool_choice` auto / any / tool / none the chat's auto / required / a named
function / none, `stop_sequences` stop strings, `thinking` the split of `--reasoning-parser`; it
goes through openai_parse.parse_chat with the conversation (the chat template, the tools prompt,
the grammar of a forced call), so the two APIs render a conversation alike.

The fields, from the official client's `messages.create` and `messages.count_tokens` (anthropic
2.17) and SGLang's `AnthropicMessagesRequest` (sglang 0.5.23), in the kinds of srt/request_fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from srt.conversation import Conversation, anthropic_messages
from srt.conversation.read import tool_of
from srt.generate_parse import RequestError, check_request_fields
from srt.openai_parse import OpenAICall, chat_prompt, parse_chat
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

# chat-body names (openai_parse's RequestError params) -> the Messages field the client set
ANTHROPIC_NAMES = {
    "stop": "stop_sequences",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "input_ids": "messages",
    "text": "messages",
    "parallel_tool_calls": "tool_choice",
    "response_format": "output_config",
    "json_schema": "output_config",
    "chat_template_kwargs": "thinking",
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_SERVER_TOOL_PREFIXES = (
    "web_search",
    "web_fetch",
    "bash",
    "text_editor",
    "computer",
    "code_execution",
    "memory",
)


@dataclass
class AnthropicCall:
    """One Messages request translated: the chat call, and what shapes its reply."""

    chat: OpenAICall
    stop_sequences: list[str]
    renamed: dict[str, str]  # /generate or chat parameter -> the Messages field


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """tools (each checked under its Messages path) and tool_choice as the chat's."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("tools must be a list of tools", "tools")
        out["tools"] = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
                raise RequestError(
                    f"tools[{i}]: Anthropic's server tool {kind} is not supported by srt", "tools"
                )
            if not isinstance(tool, dict) or kind not in (None, "custom"):
                raise RequestError(
                    f"tools[{i}] must be a custom tool with a name and an input_schema", "tools"
                )
            function = tool_of(tool, f"tools[{i}].", "input_schema")
            if function.parameters is None:
                raise RequestError(
                    f"tools[{i}].input_schema is required (a JSON schema object)", f"tools[{i}].input_schema"
                )
            out["tools"].append(function.template_form())
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise RequestError("tool_choice of type tool needs the tool's name", "tool_choice")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in _TOOL_CHOICES:
            out["tool_choice"] = _TOOL_CHOICES[kind]
        else:
            raise RequestError("tool_choice.type must be auto, any, tool or none", "tool_choice")
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
        if parallel:
            out["parallel_tool_calls"] = False
    return out


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    """thinking enabled or adaptive: the <think> part is split off (with --reasoning-parser);
    disabled: no split, and the chat template is asked not to think (enable_thinking, as Qwen3's)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "adaptive"):
        budget = thinking.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise RequestError(
                f"thinking.budget_tokens must be a positive integer, got {budget!r}", "thinking"
            )
        return {}
    if kind == "disabled":
        return {"separate_reasoning": False, "chat_template_kwargs": {"enable_thinking": False}}
    raise RequestError("thinking.type must be enabled, adaptive or disabled", "thinking")


def _output_config(body: dict[str, Any]) -> dict[str, Any]:
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
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    }


def chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], Conversation]:
    """(the chat body of its tools and settings, its conversation) of a Messages (or count_tokens)
    body whose vocabulary was checked."""
    conversation = anthropic_messages.conversation(body.get("system"), body.get("messages"))
    return {**_tools(body), **_thinking(body), **_output_config(body)}, conversation


def parse_messages(tm: TokenizerManager, body: dict[str, Any]) -> AnthropicCall:
    check_request_fields(body, MESSAGES)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens is required, a positive integer (got {max_tokens!r})", "max_tokens")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop_sequences must be a list of non-empty strings", "stop_sequences")
    chat, conversation = chat_body(body)
    chat.update(max_tokens=max_tokens, stream=body.get("stream") or False)
    if stops:
        chat["stop"] = stops
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):  # Anthropic's ranges
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise RequestError(f"{name}: must be a number from {low:g} to {high:g} (got {value!r})", name)
        chat[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise RequestError(f"top_k: must be an integer of 0 or more (got {top_k!r})", "top_k")
        chat["top_k"] = top_k if top_k > 0 else -1  # 0: no top-k cut, as -1 is here
    call = parse_chat(tm, chat, conversation)
    renamed = {gen: ANTHROPIC_NAMES.get(name, name) for gen, name in call.renamed.items()}
    return AnthropicCall(call, stops, {**ANTHROPIC_NAMES, **renamed})


def count_tokens(tm: TokenizerManager, body: dict[str, Any]) -> int:
    """The tokens a Messages body's prompt takes (its system prompt, turns and tools)."""
    check_request_fields(body, COUNT_TOKENS)
    return len(chat_prompt(tm, *chat_body(body)).input_ids)
