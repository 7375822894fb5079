"""A typed conversation to the model's prompt: the messages the chat template takes, the tools
rendered by the template or by srt's generic prompt (srt/tool_template.py), then the template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2

from srt.conversation.model import Message
from srt.conversation.request import ChatRequest
from srt.generate_parse import RequestError
from srt.tool_calls import ToolPlan
from srt.tool_template import chat_tools

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager


def template_message(message: Message) -> dict[str, Any]:
    """A message as chat templates take it (OpenAI's chat shape, a call's arguments decoded)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    if message.call_id is not None:
        out["tool_call_id"] = message.call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return out


@dataclass
class ChatPrompt:
    """A chat request's prompt: the tokens its messages (and tools) render to, and its ToolPlan."""

    input_ids: list[int]
    tools: ToolPlan | None


def render_prompt(tm: TokenizerManager, request: ChatRequest) -> ChatPrompt:
    """The prompt of a request's conversation with its tools and template options; RequestError
    naming its conversation's field, tools or tool_choice."""
    if not getattr(tm.tokenizer, "chat_template", None):
        raise RequestError(
            "this model has no chat template (a base model): send the text to /v1/completions or "
            "/generate, or start the server with --chat-template FILE",
            request.conversation_field,
        )
    messages = [template_message(m) for m in request.conversation.messages]
    tools = [tool.template_form() for tool in request.tools]
    flag = tm.server_args.tool_call_parser
    prepared = chat_tools(
        tm.tokenizer, flag, tools, request.tool_choice, request.parallel_tool_calls, messages
    )
    # continuing the final message: no generation prompt after it (as SGLang and transformers)
    options = {"add_generation_prompt": True, "continue_final_message": False, **request.template_options}
    if prepared.template_tools is not None:
        options["tools"] = prepared.template_tools
    try:
        text = tm.tokenizer.apply_chat_template(prepared.conversation, tokenize=False, **options)
    except (ValueError, jinja2.TemplateError) as error:  # no chat template, or raise_exception() in it
        raise RequestError(f"cannot apply the chat template: {error}", request.conversation_field) from None
    # The template already wrote the special tokens (BOS included), so do not add them again.
    return ChatPrompt(list(tm.tokenizer(text, add_special_tokens=False)["input_ids"]), prepared.plan)
