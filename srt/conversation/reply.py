"""A chat turn's reply, typed: the content and reasoning the model wrote, the tool calls parsed from
it, why it ended and what it used. `ReplyReader` reads one choice's cumulative outputs (the
engine's) into `Reply`s: the whole reply, or in a stream what is new since the last. Each API's
adapter spells them (OpenAI's choice, Anthropic's blocks, a Response's items) and mints its own
call ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srt.reasoning import ReasoningSplit
from srt.tool_calls import ToolCall, ToolPlan


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt's, read from the prefix cache

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Usage:
        return cls(meta["prompt_tokens"], meta["completion_tokens"], meta.get("cached_tokens", 0))


@dataclass(frozen=True)
class Reply:
    """A whole reply, or a stream's delta (what is new since the last)."""

    content: str | None  # None: a turn of calls with no text (a delta's: no text yet)
    reasoning: str | None  # what --reasoning-parser split off; None: none (new)
    tool_calls: list[ToolCall]  # a delta's: the calls complete since the last
    finish_reason: str | None  # stop | length | tool_calls | abort; None while the turn runs
    stop: str | None = None  # the stop string (or stop_regex pattern) that ended it
    first: bool = True  # a delta's: the turn's first
    calls_before: int = 0  # a delta's: how many calls earlier deltas sent


@dataclass
class ReplyReader:
    """One choice's reply as its outputs arrive: what was sent so far (a stream sends only what is
    new). With tools, content streams only up to where a call could begin, and each call once, as
    soon as it is complete; the finished output's calls make the finish reason `tool_calls`."""

    tools: ToolPlan | None = None
    reasoning: ReasoningSplit | None = None
    _text: str = ""  # content sent so far
    _reasoning: str = ""
    _calls: int = 0
    _first: bool = field(default=True)

    def read(self, out: dict[str, Any], whole: bool) -> Reply:
        """The reply of a finished output (`whole`), or what is new in a stream's output."""
        finish = out["meta_info"]["finish_reason"]
        reason = None if finish is None else str(finish["type"])
        text, reasoning = out["text"], None
        if self.reasoning is not None:
            text, reasoning = self._split(text, whole, reason is not None)
        calls: list[ToolCall] = []
        if self.tools is None:
            content: str | None = text[len(self._text) :]
            self._text = text
        else:
            content, calls, reason = self._tool_part(text, whole, reason)
        calls_before = self._calls
        if not whole:
            calls = calls[self._calls :]
            self._calls += len(calls)
        first, self._first = self._first, False
        matched = finish.get("matched") if finish is not None else None
        stop = matched if isinstance(matched, str) else None
        return Reply(content, reasoning, calls, reason, stop, first, calls_before)

    def _split(self, text: str, whole: bool, finished: bool) -> tuple[str, str | None]:
        """(the content part, the reasoning to send: all of it in a whole reply; in a stream what
        is new, or with stream_reasoning false all of it once it ended)."""
        assert self.reasoning is not None
        reasoning, content, done = self.reasoning.split(text, finished)
        if whole:
            return content, reasoning or None
        if not self.reasoning.stream_reasoning and not done:
            return content, None
        new = reasoning[len(self._reasoning) :] if reasoning.startswith(self._reasoning) else ""
        self._reasoning = max(reasoning, self._reasoning, key=len)
        return content, new or None

    def _tool_part(
        self, text: str, whole: bool, reason: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish reason) of an output that may hold tool calls."""
        assert self.tools is not None
        if reason is None:
            safe = text[: self.tools.stream_safe_prefix(text)]
            content = safe[len(self._text) :] if len(safe) > len(self._text) else ""
            self._text = max(safe, self._text, key=len)
            return content, [] if whole else self.tools.complete_calls(text), reason
        parsed, calls = self.tools.parse(text)
        if calls and reason == "stop":
            reason = "tool_calls"
        sent, self._text = self._text, text
        if whole:
            return parsed, calls, reason
        rest = parsed or ""
        new = rest[len(sent) :] if rest.startswith(sent) else ""
        return (None if not new and calls else new), calls, reason
