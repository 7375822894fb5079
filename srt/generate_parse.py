"""Validation and tokenization of a /generate body into the requests sent to rank 0.

Bad input raises RequestError (an HTTP 400) naming the parameter, before anything reaches a rank.
Fields: text or input_ids (one prompt or a batch), sampling_params (one object, or one per batch
item), stream, rid, and SGLang's logprob options return_logprob, top_logprobs_num and
logprob_start_len (a value, or one per batch item) with return_text_in_logprobs.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from srt.io_struct import TokenizedGenerateReq
from srt.sampling_params import SamplingParams

GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "rid", "return_logprob", "top_logprobs_num",
                   "logprob_start_len", "return_text_in_logprobs")
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class RequestError(ValueError):
    """Bad client input (HTTP 400); `param` names the offending parameter when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class GenerateCall:
    reqs: list[TokenizedGenerateReq]
    is_batch: bool
    stream: bool
    return_text_in_logprobs: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any, vocab_size: int) -> bool:
    return _is_int(value) and 0 <= value < vocab_size


def _bool(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name) or False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name)
    return value


class GenerateParser:
    def __init__(self, tokenizer: Any, vocab_size: int, context_length: int, max_total_tokens: int | None,
                 resolve_seed: Callable[[SamplingParams], int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.max_total_tokens = max_total_tokens
        self.resolve_seed = resolve_seed

    def parse(self, obj: Any, busy_rids: Container[str]) -> GenerateCall:
        if not isinstance(obj, dict):
            raise RequestError("the request must be a JSON object")
        unknown = sorted(set(obj) - set(GENERATE_FIELDS))
        if unknown:
            raise RequestError(f"unknown parameter(s): {', '.join(unknown)} (allowed: {', '.join(GENERATE_FIELDS)})",
                               unknown[0])
        if (obj.get("text") is None) == (obj.get("input_ids") is None):
            both = obj.get("text") is not None
            raise RequestError("give either text or input_ids, not both" if both else
                               "a prompt is required: give text or input_ids", "input_ids" if both else "text")
        stream = _bool(obj, "stream")
        prompt_key = "text" if obj.get("text") is not None else "input_ids"
        prompts, is_batch = self._tokenize(obj["text"]) if prompt_key == "text" else self._check_ids(obj["input_ids"])
        params = self._sampling_params(obj.get("sampling_params"), len(prompts), is_batch)
        rids = self._rids(obj.get("rid"), len(prompts), is_batch, busy_rids)
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            self._check_length(ids, sp, f"{prompt_key}[{i}]: " if is_batch else "", prompt_key)
        logprobs = self._logprob_options(obj, prompts, is_batch)
        reqs = [TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=sp, seed=self.resolve_seed(sp),
                                     stream=stream, return_logprob=want, top_logprobs_num=top, logprob_start_len=start)
                for rid, ids, sp, (want, top, start) in zip(rids, prompts, params, logprobs)]
        return GenerateCall(reqs=reqs, is_batch=is_batch, stream=stream,
                            return_text_in_logprobs=_bool(obj, "return_text_in_logprobs"))

    def _check_length(self, ids: list[int], sp: SamplingParams, where: str, prompt_key: str) -> None:
        total = len(ids) + sp.max_new_tokens
        param = "max_new_tokens" if len(ids) < self.context_length else prompt_key
        if total > self.context_length:
            raise RequestError(f"{where}the prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                               f"{total} exceeds the context length ({self.context_length})", param)
        if self.max_total_tokens is not None and total > self.max_total_tokens:
            raise RequestError(f"{where}the prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                               f"{total} exceeds the KV cache capacity ({self.max_total_tokens} tokens)", param)

    def _tokenize(self, text: Any) -> tuple[list[list[int]], bool]:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a non-empty string or a non-empty list of non-empty strings", "text")
        for i, t in enumerate(texts):
            where = f"text[{i}]" if is_batch else "text"
            if not t:
                raise RequestError(f"{where} is empty", "text")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"{where} contains an unpaired surrogate (not valid Unicode)", "text") from None
        prompts = [list(ids) for ids in self.tokenizer(texts)["input_ids"]]
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"text[{i}] tokenizes to no tokens" if is_batch else "text tokenizes to no tokens",
                                   "text")
        return prompts, is_batch

    def _check_ids(self, input_ids: Any) -> tuple[list[list[int]], bool]:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)",
                               "input_ids")
        is_batch = isinstance(input_ids[0], list)
        rows = input_ids if is_batch else [input_ids]
        for i, row in enumerate(rows):
            where = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(row, list):
                raise RequestError(f"{where} must be a list of token ids", "input_ids")
            if not row:
                raise RequestError(f"{where} is empty", "input_ids")
            for token in row:
                if not _is_token_id(token, self.vocab_size):
                    raise RequestError(f"{where} holds {token!r}, not a token id in [0, {self.vocab_size})",
                                       "input_ids")
        return [list(row) for row in rows], is_batch

    def _sampling_params(self, raw: Any, n: int, is_batch: bool) -> list[SamplingParams]:
        if is_batch and isinstance(raw, list):
            if len(raw) != n:
                raise RequestError(f"sampling_params has {len(raw)} entries for a batch of {n}", "sampling_params")
            raws = raw
        else:
            raws = [raw] * n
        out = []
        for one in raws:
            for key, value in (one.items() if isinstance(one, dict) else ()):
                if isinstance(value, int) and abs(value) >= 2**63:  # JSON ints are unbounded; floats are not
                    raise RequestError(f"{key} is out of range: {value!r:.30}",
                                       key if key in _SAMPLING_FIELDS else "sampling_params")
            try:
                params = SamplingParams.from_dict(one)
                params.validate(self.vocab_size)
            except (ValueError, TypeError) as error:
                name = str(error).split(" ", 1)[0]
                raise RequestError(str(error), name if name in _SAMPLING_FIELDS else "sampling_params") from None
            out.append(params)
        return out

    def _rids(self, raw: Any, n: int, is_batch: bool, busy_rids: Container[str]) -> list[str]:
        if raw is None:
            return [uuid.uuid4().hex for _ in range(n)]
        rids = raw if is_batch else [raw]
        if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) and r for r in rids):
            shape = f"a list of {n} non-empty strings" if is_batch else "a non-empty string"
            raise RequestError(f"rid must be {shape}, got {raw!r}", "rid")
        if len(set(rids)) != n:
            raise RequestError("rid holds duplicates", "rid")
        busy = [r for r in rids if r in busy_rids]
        if busy:
            raise RequestError(f"rid {busy[0]!r} is already in flight", "rid")
        return list(rids)

    def _logprob_options(self, obj: dict[str, Any], prompts: list[list[int]],
                         is_batch: bool) -> list[tuple[bool, int, int]]:
        """(return_logprob, top_logprobs_num, logprob_start_len) per prompt. The last two matter
        only with return_logprob, as in SGLang."""
        n = len(prompts)
        wants = self._per_item(obj, "return_logprob", False, n, is_batch)
        tops = self._per_item(obj, "top_logprobs_num", 0, n, is_batch)
        starts = self._per_item(obj, "logprob_start_len", -1, n, is_batch)
        for i, (want, top, start, ids) in enumerate(zip(wants, tops, starts, prompts)):
            where = f"[{i}]" if is_batch else ""
            if not isinstance(want, bool):
                raise RequestError(f"return_logprob{where} must be a boolean, got {want!r}", "return_logprob")
            if not _is_int(top) or not 0 <= top <= self.vocab_size:
                raise RequestError(f"top_logprobs_num{where} must be an integer in [0, {self.vocab_size}], "
                                   f"got {top!r}", "top_logprobs_num")
            if not _is_int(start) or not -1 <= start < len(ids):
                raise RequestError(f"logprob_start_len{where} must be -1 (output tokens only) or a prompt position "
                                   f"in [0, {len(ids)}), got {start!r}", "logprob_start_len")
        return [(want, top if want else 0, start if want else -1) for want, top, start in zip(wants, tops, starts)]

    @staticmethod
    def _per_item(obj: dict[str, Any], name: str, default: Any, n: int, is_batch: bool) -> list[Any]:
        value = obj.get(name)
        if value is None:
            return [default] * n
        if is_batch and isinstance(value, list):
            if len(value) != n:
                raise RequestError(f"{name} has {len(value)} entries for a batch of {n}", name)
            return [default if v is None else v for v in value]
        return [value] * n
