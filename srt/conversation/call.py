"""A typed chat request made into the generate call: its prompt rendered from the request (the
chat template, the tools prompt), the rest of the context its default token limit, a forced tool
call's grammar; and what shapes the reply (the ToolPlan, the reasoning split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from srt.conversation.render import render_prompt
from srt.conversation.reply import ReplyReader
from srt.conversation.request import ChatRequest
from srt.generate_parse import RequestError
from srt.reasoning import ReasoningSplit
from srt.tool_calls import ToolPlan

if TYPE_CHECKING:
    from srt.tokenizer_manager import TokenizerManager


@dataclass
class ChatCall:
    """A chat request's generate call: the /generate body, and how its reply is read."""

    generate_body: dict[str, Any]
    stream: bool
    renamed: dict[str, str]  # /generate parameter -> the field the client set
    tools: ToolPlan | None = None  # with tools: how the output becomes tool calls
    reasoning: ReasoningSplit | None = None  # with --reasoning-parser: the <think> part apart
    n: int = 1  # choices per prompt
    include_usage: bool = False
    logprobs: bool = False

    @property
    def choices(self) -> int:
        return self.n

    def reply_reader(self) -> ReplyReader:
        """A reader of one choice's reply (srt/conversation/reply.py)."""
        return ReplyReader(self.tools, self.reasoning)


C = TypeVar("C", bound=ChatCall)


def chat_call(tm: TokenizerManager, request: ChatRequest, kind: type[C]) -> C:
    """The generate call of a typed chat request (any API's): its prompt rendered, the rest of the
    context its default token limit, a forced tool call's grammar; RequestError naming the field
    of the API the client used. `kind`: the call's class (an API's own, with more to shape its reply)."""
    prompt = render_prompt(tm, request)
    input_ids, tools = prompt.input_ids, prompt.tools
    capacity = min(tm.context_length, tm.max_total_tokens or tm.context_length)
    if len(input_ids) >= capacity:
        raise RequestError(
            f"{request.conversation_field}: the prompt takes {len(input_ids)} tokens, leaving none "
            f"of the {capacity} the server can hold",
            request.conversation_field,
        )
    default_max = capacity - len(input_ids)
    max_tokens = default_max if request.max_tokens is None else request.max_tokens
    sampling = {**request.sampling, "max_new_tokens": max_tokens}
    names = dict(request.names)
    schema = tools.json_schema() if tools is not None else None
    if schema is not None:
        if any(grammar in sampling for grammar in ("json_schema", "regex", "ebnf", "structural_tag")):
            raise RequestError(
                "tool_choice required or a named function constrains the output already: "
                f"drop {names.get('json_schema', 'response_format')}",
                "tool_choice",
            )
        sampling["json_schema"] = schema
        names["json_schema"] = "tools"
    generate_body = {
        "input_ids": input_ids,
        # a turn that may end at a repeated call is watched as it grows (srt/repeated_calls.py)
        "stream": request.stream or (tools is not None and tools.ends_at_repeat),
        **request.logprobs,
        **request.request_fields,
        "sampling_params": sampling,
    }
    parser = tm.server_args.reasoning_parser
    reasoning = (
        ReasoningSplit(parser, request.stream_reasoning) if parser and request.separate_reasoning else None
    )
    return kind(
        generate_body,
        request.stream,
        names,
        tools if tools is not None and tools.parses else None,
        reasoning,
        request.n,
        request.include_usage,
        bool(request.logprobs),
    )
