"""The typed conversation: messages of a role holding content parts, an assistant's tool calls,
and tool results that name the call they answer. Frozen values: two APIs' requests for the same
conversation compare equal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class TextPart:
    text: str


# A message's content parts; the vision issue widens the union with image parts.
Part = TextPart


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: Any  # the decoded JSON (an object, as a rule); the text as sent where it is not JSON


@dataclass(frozen=True)
class Tool:
    """A function the model may call, whichever API declared it."""

    name: str
    parameters: dict[str, Any] | None = None  # the JSON schema of its arguments
    description: str | None = None

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's function tool shape, in one key order)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Message:
    role: Role
    parts: tuple[Part, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    call_id: str | None = None  # a tool result's: the id of the call it answers
    name: str | None = None  # OpenAI's participant name; a legacy `function` result's function
    # where the client wrote call_id, in its API's words (messages[2].tool_call_id); None where no
    # id is asked for (OpenAI's legacy `function` role names its function instead)
    call_id_path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        assert not self.tool_calls or self.role == "assistant", self
        assert self.call_id is None or self.role == "tool", self

    @classmethod
    def tool_result(
        cls, parts: tuple[Part, ...], call_id: Any, call_id_path: str | None, name: str | None = None
    ) -> Message:
        """A tool result answering the call whose id the client sent as `call_id`: anything but a
        string is no id, which check.validated refuses by `call_id_path`."""
        return cls(
            "tool",
            parts,
            call_id=call_id if isinstance(call_id, str) else None,
            name=name,
            call_id_path=call_id_path,
        )

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.parts)


@dataclass(frozen=True)
class Conversation:
    """Messages in order, validated (check.validated builds one)."""

    messages: tuple[Message, ...]

    def __post_init__(self) -> None:
        assert self.messages, "a conversation has a message"
