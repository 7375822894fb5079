"""A request's logprobs as /generate returns them in meta_info, in SGLang's shape:

    output_token_logprobs: [[logprob, token_id, text or null], ...]       one per output token
    output_top_logprobs:   [[[logprob, token_id, text or null], ...], ...]  (top_logprobs_num > 0)
    output_token_ids_logprobs: [[[logprob, token_id, text or null], ...], ...]  (token_ids_logprob:
                           those ids at each position, in the order asked)
    input_token_logprobs / input_top_logprobs / input_token_ids_logprobs: the same for the prompt
                           tokens from logprob_start_len on (logprob_start_len >= 0); the first
                           prompt token's logprob is null, as nothing precedes it

Texts are filled when the request asked for return_text_in_logprobs (the OpenAI routes do).
Entries are built once, when they arrive; a stream's cumulative lists only copy references.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from srt.io_struct import TokenLogprobs

Entry = list[Any]  # [logprob, token_id, text or None]


class LogprobMeta:
    def __init__(
        self,
        top_logprobs_num: int,
        logprob_start_len: int,
        decode: Callable[[list[int]], list[str]] | None,
        with_ids: bool = False,
    ) -> None:
        self.with_top = top_logprobs_num > 0
        self.with_ids = with_ids  # token_ids_logprob was asked for
        self.with_input = logprob_start_len >= 0
        self.decode = decode  # token ids -> one text per id; None: texts stay null
        self.output_token: list[Entry] = []
        self.output_top: list[list[Entry] | None] = []
        self.input_token: list[Entry] = []
        self.input_top: list[list[Entry] | None] = []
        self.output_ids: list[list[Entry] | None] = []
        self.input_ids: list[list[Entry] | None] = []

    def add(self, output: TokenLogprobs | None, prompt: TokenLogprobs | None) -> None:
        if prompt is not None:
            self._extend(prompt, self.input_token, self.input_top, self.input_ids)
        if output is not None:
            self._extend(output, self.output_token, self.output_top, self.output_ids)

    def _extend(
        self,
        chunk: TokenLogprobs,
        tokens: list[Entry],
        tops: list[list[Entry] | None],
        asked: list[list[Entry] | None],
    ) -> None:
        ranked = [top for top in chunk.top if top is not None] if self.with_top else []
        chosen = [pair for pair in chunk.ids if pair is not None] if self.with_ids else []
        texts: Iterator[str | None] = itertools.repeat(None)
        if self.decode is not None:  # one tokenizer call: the chosen tokens, the alternatives, the asked ids
            texts = iter(
                self.decode(
                    list(chunk.token_ids)
                    + [i for _, ids in ranked for i in ids]
                    + [i for _, ids in chosen for i in ids]
                )
            )
        for value, token in zip(chunk.values, chunk.token_ids):
            tokens.append([value, token, next(texts)])
        if self.with_top:
            for top in chunk.top:  # None for the first prompt token: nothing to rank
                tops.append(None if top is None else [[v, i, next(texts)] for v, i in zip(*top)])
        if self.with_ids:
            for pair in chunk.ids or [None] * len(chunk.values):
                asked.append(None if pair is None else [[v, i, next(texts)] for v, i in zip(*pair)])

    def meta_info(self, output_from: int = 0) -> dict[str, Any]:
        """The lists so far; with output_from > 0 (an incremental stream's later chunk) only the
        output entries from that token on, and no prompt entries (the first chunk had them)."""
        meta: dict[str, Any] = {"output_token_logprobs": self.output_token[output_from:]}
        if self.with_top:
            meta["output_top_logprobs"] = self.output_top[output_from:]
        if self.with_ids:
            meta["output_token_ids_logprobs"] = self.output_ids[output_from:]
        if self.with_input and output_from == 0:
            meta["input_token_logprobs"] = list(self.input_token)
            if self.with_top:
                meta["input_top_logprobs"] = list(self.input_top)
            if self.with_ids:
                meta["input_token_ids_logprobs"] = list(self.input_ids)
        return meta
