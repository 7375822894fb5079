"""A Response's output items, built from a reply's deltas (or the whole reply), and the
stream events that send them: a `reasoning` item (`reasoning_text`), a `message` item (one
`output_text` part), a `function_call` item per complete call (its call_id minted here). One item is open while its text
grows; a delta of the other kind, or a call, closes it first."""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

from srt.conversation.reply import Reply
from srt.tool_calls import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class OutputItems:
    """A response's output items as the reply's deltas arrive, and the stream's events that
    build them: one item is open (reasoning or message) while its text grows."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: str | None = None  # "reasoning" | "message" while one is open

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        """output_item.added with `item` as it starts; the list holds a copy that grows."""
        self.items.append(copy.deepcopy(item))
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item: its text's done events, then output_item.done."""
        if self.open is None:
            return []
        item, where = self.items[-1], self._where()
        if self.open == "reasoning":
            text = item["content"][0]["text"]
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}]
        else:
            part = item["content"][0]
            events = [
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        item["status"] = status
        self.open = None
        return [
            *events,
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": item},
        ]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if self.open == kind:
            return []
        events = self.close()
        self.open = kind
        if kind == "reasoning":
            item = {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            events.append(self._added(item))
            self.items[-1]["content"] = [{"type": "reasoning_text", "text": ""}]
            return events
        item = {
            "type": "message",
            "id": new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        events.append(self._added(item))
        self.items[-1]["content"] = [_text_part("")]
        events.append(
            {
                "type": "response.content_part.added",
                **self._where(),
                "content_index": 0,
                "part": _text_part(""),
            }
        )
        return events

    def text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        """Reasoning or message text, in the open item of its kind (a new one if another is open)."""
        events = self._open(kind)
        self.items[-1]["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": name, **self._where(), "content_index": 0, "delta": delta}
        if kind == "message":
            event["logprobs"] = []
        return [*events, event]

    def function_call(self, call: ToolCall) -> list[dict[str, Any]]:
        """A complete call: its item added with no arguments, then them as one delta."""
        events = self.close()
        item = {
            "type": "function_call",
            "id": new_id("fc"),
            "call_id": new_id("call"),
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        events.append(self._added(item))
        arguments = call.arguments
        self.items[-1].update(arguments=arguments, status="completed")
        where = self._where()
        return [
            *events,
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {"type": "response.function_call_arguments.done", **where, "arguments": arguments},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": self.items[-1],
            },
        ]

    def add(self, reply: Reply) -> list[dict[str, Any]]:
        """A reply's delta (or a whole reply) as items, and the events that sent them."""
        events = []
        if reply.reasoning:
            events += self.text("reasoning", reply.reasoning)
        if reply.content:
            events += self.text("message", reply.content)
        for call in reply.tool_calls:
            events += self.function_call(call)
        return events
