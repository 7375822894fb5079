"""Tools on any chat template: whether the model's template renders `tools`, which parser reads
the calls it asks for, and srt's generic tool prompt for a template that renders none.

A template is probed once per tokenizer: a one-message conversation rendered with a dummy tool
must show the tool's name. One that does shows its own call format, recognised from its text
(`<tool_call>` blocks: `qwen25`; Llama 3's `<|python_tag|>` or `ipython` turns: `llama3`). One that
does not (SmolLM2's, say) would drop the tools silently, so srt writes them into the system message
itself, with the generic call format: reply with only a JSON array of
`{"name": ..., "parameters": {...}}` objects, the same array the grammar of tool_choice required
or a named function produces, so prompt and constraint agree. Past calls and tool results,
which such a template cannot render, become plain assistant and user turns in that format.
`--tool-call-parser` overrides the parser chosen; `generic` also makes srt write the tools prompt
on a template that renders tools.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import jinja2

from srt.tool_calls import ToolChoice, ToolPlan, plan_tools

_PROBE_NAME = "srt_probe_function"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_NAME,
            "description": "Checks whether the chat template renders tools.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
_PROBE_CONVERSATION = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class TemplateTools:
    """What a tokenizer's chat template does with `tools`."""

    renders_tools: bool
    parser: str | None  # the parser for the calls its prompt asks for; None: a format srt does not know


_probed: weakref.WeakKeyDictionary[Any, TemplateTools] = weakref.WeakKeyDictionary()


def template_parser(template: str) -> str | None:
    """The parser for a template that renders tools, recognised from its text (None: unknown)."""
    if "<tool_call>" in template:
        return "qwen25"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "ipython" in template):
        return "llama3"
    return None


def _render(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str | None:
    try:
        text = tokenizer.apply_chat_template(
            _PROBE_CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except (ValueError, jinja2.TemplateError):  # no template, or one that refuses tools
        return None
    return str(text)


def probe_template(tokenizer: Any) -> TemplateTools:
    """Whether the template renders tools (cached per tokenizer). A template that cannot render a
    plain conversation is left alone: the request's own rendering reports its error."""
    known = _probed.get(tokenizer)
    if known is not None:
        return known
    if _render(tokenizer, None) is None:
        known = TemplateTools(True, None)
    else:
        with_tools = _render(tokenizer, _PROBE_TOOLS)
        if with_tools is not None and _PROBE_NAME in with_tools:
            known = TemplateTools(True, template_parser(tokenizer.get_chat_template(tools=_PROBE_TOOLS)))
        else:
            known = TemplateTools(False, "generic")
    _probed[tokenizer] = known
    return known


@dataclass
class ChatTools:
    """A chat request's tools, ready to render."""

    plan: ToolPlan | None
    conversation: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None  # apply_chat_template's `tools` (None: not passed)


def chat_tools(
    tokenizer: Any,
    flag: str | None,
    tools: list[dict[str, Any]],
    choice: ToolChoice,
    parallel: bool,
    conversation: list[dict[str, Any]],
) -> ChatTools:
    """The request's ToolPlan and what the template gets: the tools themselves (`tools`, in the
    template's form) where it renders them, else the generic prompt in the conversation.
    RequestError as plan_tools."""
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in conversation)
    if not tools and not has_tool_turns:
        return ChatTools(plan_tools(tools, choice, parallel, flag), conversation, None)  # checks the choice
    template = probe_template(tokenizer)
    plan = plan_tools(tools, choice, parallel, flag or template.parser)
    if template.renders_tools and flag != "generic":
        return ChatTools(plan, conversation, plan.tools if plan is not None else None)
    return ChatTools(plan, generic_conversation(conversation, plan), None)


def calls_text(calls: list[dict[str, Any]]) -> str:
    """OpenAI tool_calls (arguments already decoded) in the generic format."""
    return json.dumps(
        [
            {"name": c["function"].get("name"), "parameters": c["function"].get("arguments", {})}
            for c in calls
        ],
        ensure_ascii=False,
    )


def tools_prompt(plan: ToolPlan) -> str:
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    array = "a JSON array of calls" if plan.parallel else "a JSON array holding one call"
    ask = {
        "auto": "If no function helps, answer in plain text instead.",
        "required": "Call a function now.",
        "function": f"Call {plan.function} now.",
    }[plan.choice]
    return (
        f"You can call these functions, each given with the JSON schema of its parameters:\n{functions}\n\n"
        f"To call functions, reply with only {array}, in this form:\n"
        '[{"name": "<function name>", "parameters": {<arguments matching its schema>}}]\n'
        f"The results come back in the next message. {ask}"
    )


def generic_conversation(conversation: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: each assistant turn's tool_calls as
    the generic array after its text, each run of tool results as one user turn (templates that
    require turns to alternate accept it), and the tools prompt in the system message when the
    plan may call."""
    names = {c.get("id"): c["function"].get("name") for m in conversation for c in m.get("tool_calls") or []}
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn the current run of tool results goes to
    for message in conversation:
        if message["role"] == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id")) or "the function"
            line = f"{name} returned: {message['content']}"
            if results is not None and out[-1] is results:
                results["content"] += "\n" + line
            else:
                results = {"role": "user", "content": f"Function results:\n{line}"}
                out.append(results)
        elif message.get("tool_calls"):
            text = "\n".join(t for t in (message["content"], calls_text(message["tool_calls"])) if t)
            out.append({"role": message["role"], "content": text})
        else:
            out.append(message)
    if plan is not None and plan.choice != "none":
        prompt = tools_prompt(plan)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
