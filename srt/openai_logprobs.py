"""OpenAI `logprobs` objects, built from /generate's meta_info entries ([logprob, token_id, text]).

/v1/completions (legacy shape): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; each
top_logprobs dict holds the `logprobs` most likely tokens plus the chosen one (so up to
logprobs + 1 entries, as OpenAI documents), keyed by token text. text_offset is the character
offset of each token in the completion text, counted over the tokens' own texts.

/v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": null}. `bytes` is the UTF-8 encoding of the token's text (a token that is only part
of a character decodes to U+FFFD, whose bytes are given).

A streamed chunk carries the objects of the tokens that arrived with it.
"""

from __future__ import annotations

from typing import Any

Entry = list[Any]  # [logprob, token_id, text]


def completion_logprobs(
    tokens: list[Entry], tops: list[list[Entry] | None] | None, text_offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy object for these tokens, with offsets from `text_offset`; also the offset after
    them (where the next chunk's tokens start)."""
    texts = [str(entry[2]) for entry in tokens]
    offsets = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    top_logprobs: list[dict[str, Any] | None] = []
    for i, entry in enumerate(tokens):
        if entry[0] is None:  # an echoed prompt's first token: nothing precedes it (OpenAI's null)
            top_logprobs.append(None)
            continue
        ranked = {str(alt[2]): alt[0] for alt in (tops[i] or [])} if tops is not None else {}
        ranked.setdefault(str(entry[2]), entry[0])
        top_logprobs.append(ranked)
    return {
        "tokens": texts,
        "token_logprobs": [entry[0] for entry in tokens],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }, text_offset


def _chat_item(entry: Entry) -> dict[str, Any]:
    text = str(entry[2])
    return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: list[Entry], tops: list[list[Entry] | None] | None) -> dict[str, Any]:
    content = [
        {**_chat_item(entry), "top_logprobs": [_chat_item(alt) for alt in (tops[i] or [])] if tops else []}
        for i, entry in enumerate(tokens)
    ]
    return {"content": content, "refusal": None}
