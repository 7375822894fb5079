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

from srt.server_args import REASONING_PARSERS

THINK_START, THINK_END = "<think>", "</think>"
_FORCED = {"deepseek-r1": True, "qwen3": False, "qwen3-thinking": True}
assert set(_FORCED) == set(REASONING_PARSERS)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


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
            body = body[len(THINK_START):]
        elif not _FORCED[self.parser]:
            return "", text, True  # not a reasoning output: all content
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end].strip(), body[end + len(THINK_END):].lstrip(), True
        if finished:
            return body.strip(), "", True  # cut short inside the reasoning: all of it is reasoning
        # trailing whitespace waits too: the finished reasoning is stripped
        return body[:len(body) - _held_back(body, THINK_END)].strip(), "", False
