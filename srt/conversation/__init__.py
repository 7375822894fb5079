"""One typed chat request and reply for every chat API.

A chat request arrives as OpenAI chat `messages`, Anthropic Messages `system` + `messages`, or
Responses `instructions` + `input` items; each API's adapter here (`openai_chat.py`,
`anthropic_messages.py`, `responses_input.py`) reads its JSON into the same typed `Conversation`
(`model.py`), checking each field as that API does and naming it by the client's path
(`messages[2].tool_call_id`, `messages[1].content[0].tool_use_id`, `input[3].call_id`). The
conversation, tools and typed tool choice, sampling and streaming make the `ChatRequest`
(`request.py`) that each API's parser builds (srt/openai_parse.py, anthropic_parse.py,
responses_parse.py) and `call.py` makes into the generate call. `check.py` validates what every API
shares (each tool result answers an earlier call by its id); `read.py` holds the readers the
adapters share (roles, content parts, call arguments, tools); `render.py` turns a request into the
chat template's prompt; `reply.py` reads the engine's output into the typed `Reply` (content,
reasoning, parsed tool calls, finish reason) that each API's route spells, minting its own call ids.
Content parts are a typed union (`Part`): text today, images next.
"""

from srt.conversation.check import validated
from srt.conversation.model import Conversation, Message, Part, Role, TextPart, Tool, ToolCall

__all__ = ["Conversation", "Message", "Part", "Role", "TextPart", "Tool", "ToolCall", "validated"]
