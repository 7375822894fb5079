"""A forced tool-call turn that ends at its first repeated call.

`tool_choice` required with parallel calls (Anthropic's `any`; every client's default) lets the
model write call after call, and a small greedy model writes the same call again until the token
limit. Such a request streams internally, whatever the client asked, so its output is seen as it
grows: once its complete calls hold one identical to an earlier one (same name, same parsed
arguments; ToolPlan.repeat_start), the request is aborted through the tokenizer manager and its
last output is the text before the repeat, finished as a stop. Every reply is shaped from that
output, so the chat's finish_reason is `tool_calls`, Anthropic's stop_reason `tool_use` and the
Response `completed`, with the same calls streamed or not.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from srt.conversation.call import ChatCall

REPEAT_REASON = "a tool call repeated an earlier one: the turn ends with the calls before it"

Outputs = AsyncGenerator[dict[str, Any], None]
Abort = Callable[[str, str], Awaitable[Any]]  # (rid, reason): TokenizerManager.abort_request


def end_at_repeated_call(call: ChatCall, outputs: Outputs, abort: Abort) -> Outputs:
    """`outputs` (TokenizerManager.generate's) ending at the first repeated call where the call's
    plan is watched (ToolPlan.ends_at_repeat), else `outputs` unchanged. A call the client does not
    stream gets only finished outputs, as from generate."""
    if call.tools is None or not call.tools.ends_at_repeat:
        return outputs
    return _until_repeat(call, outputs, abort)


async def _until_repeat(call: ChatCall, outputs: Outputs, abort: Abort) -> Outputs:
    assert call.tools is not None
    done: set[int] = set()  # the choices (by index) whose last output was given
    async with aclosing(outputs):  # leaving early closes generate, which aborts what still runs
        async for out in outputs:
            index = out.get("index", 0)
            if index in done:
                continue  # the abort that followed a repeat
            meta = out["meta_info"]
            finish = meta["finish_reason"]
            aborted = finish is not None and finish["type"] == "abort"
            cut = None if aborted else call.tools.repeat_start(out["text"])
            if cut is not None:
                if finish is None:
                    await abort(meta["id"], REPEAT_REASON)
                finish = {"type": "stop", "matched": None}
                out = {**out, "text": out["text"][:cut], "meta_info": {**meta, "finish_reason": finish}}
            if finish is not None:
                done.add(index)
            if call.stream or finish is not None:
                yield out
            if len(done) == call.choices:
                return
