"""Reasoning models' `<think>` split on /v1/chat/completions: `--reasoning-parser` (SGLang's names)
and the request's `separate_reasoning` / `stream_reasoning`.

The text between `<think>` and `</think>` becomes the message's `reasoning_content`, the rest its
`content`. `deepseek-r1` and `qwen3-thinking` read the output as reasoning from its first token (their
chat templates may open the `<think>` in the prompt), until `</think>`; `qwen3` only when the output
opens with `<think>` (thinking can be switched off per request with `chat_template_kwargs`). While a
stream runs, a partial tag at the end of the text is held back, so neither part ever shows half a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.detokenizer import stop_holdback_start
from srt.server_args import REASONING_PARSERS

THINK_START, THINK_END = "<think>", "</think>"
_FORCED = {"deepseek-r1": True, "qwen3": False, "qwen3-thinking": True}
assert set(_FORCED) == set(REASONING_PARSERS)


@dataclass(frozen=True)
class ReasoningSplit:
    parser: str
    stream_reasoning: bool = True

    def split(self, text: str, finished: bool) -> tuple[str, str, bool]:
        """(reasoning, content, reasoning_done) of the cumulative output `text`. Unfinished: only
        what can no longer change (a partial tag at the end stays back)."""
        body = text.lstrip()
        if not finished and THINK_START.startswith(body):
            return "", "", False  # nothing yet, or perhaps a <think> being written
        if body.startswith(THINK_START):
            body = body[len(THINK_START) :]
        elif not _FORCED[self.parser]:
            return "", text, True  # not a reasoning output: all content
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end].strip(), body[end + len(THINK_END) :].lstrip(), True
        if finished:
            return body.strip(), "", True  # cut short inside the reasoning: all of it is reasoning
        # a partial </think> at the end waits, and trailing whitespace too: the finished reasoning is stripped
        return body[: stop_holdback_start(body, 0, [THINK_END])].strip(), "", False
