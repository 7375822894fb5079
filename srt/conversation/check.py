"""What every chat API checks of a whole conversation: each tool result answers a call of an
earlier assistant turn, by its id (OpenAI, Anthropic and Responses all refuse one that does not)."""

from __future__ import annotations

from collections.abc import Iterable

from srt.conversation.model import Conversation, Message
from srt.generate_parse import RequestError


def validated(messages: Iterable[Message], call: str) -> Conversation:
    """The conversation of `messages`; RequestError naming the client's path of a tool result's id
    that is missing or answers no earlier call. `call` is what the API calls a call ("tool_use
    block"), for the message."""
    called: set[str] = set()
    out = tuple(messages)
    for message in out:
        called.update(c.id for c in message.tool_calls)
        path = message.call_id_path
        if message.role != "tool" or path is None:
            continue
        if message.call_id is None:
            raise RequestError(f"{path} is required: the id of the {call} it answers", path)
        if message.call_id not in called:
            raise RequestError(f"{path} {message.call_id!r} answers no {call} of an earlier message", path)
    return Conversation(out)
