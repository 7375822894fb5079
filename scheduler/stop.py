"""Stop conditions, checked after each sampled token. Every rank runs the same check on the same
ids, so every rank finishes a request at the same step."""

from __future__ import annotations

import re
from typing import Any

from scheduler.req import Req
from srt.io_struct import FinishReason


class StopChecker:
    def __init__(self, eos_token_ids: set[int], tokenizer_loader: Any) -> None:
        self.eos_token_ids = eos_token_ids
        self._tokenizer_loader = tokenizer_loader  # called once, only if a request has stop strings
        self._tokenizer: Any = None

    def _decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_loader()
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def check(self, req: Req) -> FinishReason | None:
        params = req.sampling_params
        if len(req.output_ids) < params.min_new_tokens:
            return None  # no stop before min_new_tokens (as SGLang); its EOS and stop ids were masked
        token = req.output_ids[-1]
        if token in params.stop_token_ids:
            return FinishReason("stop", matched=token)
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason("stop", matched=token)
        if params.stop:
            # A stop string may span tokens; a token is at least one character, so the last
            # (longest stop + 2) tokens hold any match that ends at this token.
            window = max(len(s) for s in params.stop) + 2
            tail = self._decode(req.output_ids[-window:])
            for stop in params.stop:
                if stop in tail:
                    return FinishReason("stop", matched=stop)
        if params.stop_regex:
            # The window holds any match that ends at this token (all of the output when a pattern's
            # matches have no bounded length).
            regex_window = params.stop_regex_window
            tail = self._decode(req.output_ids if regex_window is None else req.output_ids[-regex_window:])
            for pattern in params.stop_regex:
                if re.search(pattern, tail):
                    return FinishReason("stop", matched=pattern, regex=True)
        if len(req.output_ids) >= params.max_new_tokens:
            return FinishReason("length")
        return None
