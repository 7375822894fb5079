"""A chat request, typed, whichever API sent it: the conversation and its tools, the tool choice,
how the output is sampled and constrained, and how the reply goes out. Each API's adapter builds
one from its own fields, checked there under its own names (srt/openai_parse.py,
srt/anthropic_parse.py, srt/responses_parse.py); call.py makes the generate call of it, rendering
the prompt from it (render.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srt.conversation.model import Conversation, Tool
from srt.tool_calls import NamedTool, ToolChoice

__all__ = ["ChatRequest", "NamedTool", "ToolChoice"]


@dataclass(frozen=True)
class ChatRequest:
    conversation: Conversation
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    # /generate's sampling_params by its names (temperature, stop, json_schema, ...): the generate
    # parser checks their values, its errors named by `names`
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: Any = None  # None: the rest of the context
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: dict[str, Any] = field(default_factory=dict)  # /generate's logprob fields; empty: none
    separate_reasoning: bool = True  # with --reasoning-parser: the <think> part apart from the content
    stream_reasoning: bool = True
    template_options: dict[str, Any] = field(default_factory=dict)  # apply_chat_template's extra arguments
    request_fields: dict[str, Any] = field(default_factory=dict)  # /generate's rid, priority
    # a /generate parameter -> the field the client set (a 400 of the generate parser names it);
    # "input_ids" is where the conversation came from (messages, input)
    names: dict[str, str] = field(default_factory=dict)

    @property
    def conversation_field(self) -> str:
        return self.names.get("input_ids", "messages")
