"""What the chat-shaped routes' tests share: the weather tool's schema, and made-up outputs of a
reasoning model (a random model does not think), as the TokenizerManager yields them."""

from __future__ import annotations

from typing import Any

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}

# a stream's cumulative texts: thinking, a partial closing tag held back, then the answer
THINKING = [
    "<think>Rain",
    "<think>Rain is likely</thi",
    "<think>Rain is likely</think>Take an",
    "<think>Rain is likely</think>Take an umbrella.",
]


def made_up_outputs(texts: list[str]) -> list[dict[str, Any]]:
    """One output per cumulative text, the last finished by EOS: 7 prompt tokens, 2 of them cached."""
    outs = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        meta = {
            "id": "r1",
            "prompt_tokens": 7,
            "completion_tokens": i + 1,
            "cached_tokens": 2,
            "finish_reason": {"type": "stop", "matched": 2} if last else None,
        }
        outs.append({"text": text, "meta_info": meta})
    return outs
