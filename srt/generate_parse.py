"""Validation and tokenization of a /generate body into the requests sent to rank 0.

Bad input raises RequestError (an HTTP 400) naming the parameter, before anything reaches a rank.
Fields: SGLang's GenerateReqInput (srt/request_fields.py says which are implemented, which are
accepted only at their defaults, which carry no meaning here): text or input_ids (one prompt or
a batch), sampling_params (one object, or one per batch item; `n` > 1 fans each prompt out into n
requests with seeds derived from the request's, results ordered prompt by prompt), stream, rid,
the logprob options return_logprob, top_logprobs_num and logprob_start_len (a value, or one per
batch item) with return_text_in_logprobs, return_prompt_token_ids, priority (with
--enable-priority-scheduling), log_metrics, and lora_path (an adapter's name, or one per batch item,
with --enable-lora).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Container, Mapping
from dataclasses import dataclass
from typing import Any

from model_executor.constrained import GrammarError, LazyGrammarBackend
from srt.io_struct import TokenizedGenerateReq
from srt.request_fields import GENERATE, SAMPLING, Field, VocabularyError, check_fields
from srt.sampling_params import SamplingParams

MAX_N = 128  # copies of one prompt (`n`)


class RequestError(ValueError):
    """Bad client input (HTTP 400); `param` names the offending parameter when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class GenerateCall:
    reqs: list[TokenizedGenerateReq]
    is_batch: bool  # the reply is a list (a batch of prompts, or n > 1)
    stream: bool
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    log_metrics: bool = True


def derived_seed(seed: int, i: int) -> int:
    """The seed of copy i of a request fanned out by `n` (copy 0 keeps the request's own)."""
    return seed if i == 0 else (seed + i * 0x9E3779B97F4A7C15) % 2**63


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request_fields(
    body: dict[str, Any], vocabulary: Mapping[str, Field], per_item: bool = False
) -> None:
    """check_fields for a route's body, its VocabularyError as the RequestError (a 400) naming the field."""
    try:
        check_fields(body, vocabulary, per_item=per_item)
    except VocabularyError as error:
        raise RequestError(str(error), error.param) from None


def is_token_id(value: Any, vocab_size: int) -> bool:
    return is_int(value) and 0 <= value < vocab_size


def _bool(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name) or False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name)
    return value


class GenerateParser:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        context_length: int,
        max_total_tokens: int | None,
        resolve_seed: Callable[[SamplingParams], int],
        priority_scheduling: bool = False,
        grammars: LazyGrammarBackend | None = None,
        return_routed_experts: bool = False,
        lora_names: Collection[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.max_total_tokens = max_total_tokens
        self.resolve_seed = resolve_seed
        self.priority_scheduling = priority_scheduling
        self.grammars = grammars  # None: grammars are refused (no backend)
        self.return_routed_experts = return_routed_experts  # --enable-return-routed-experts
        self.lora_names = lora_names  # the adapters requests may name; None: LoRA off

    def parse(self, obj: Any, busy_rids: Container[str]) -> GenerateCall:
        if not isinstance(obj, dict):
            raise RequestError("the request must be a JSON object")
        check_request_fields(obj, GENERATE, per_item=True)
        if (obj.get("text") is None) == (obj.get("input_ids") is None):
            both = obj.get("text") is not None
            raise RequestError(
                "give either text or input_ids, not both"
                if both
                else "a prompt is required: give text or input_ids",
                "input_ids" if both else "text",
            )
        stream = _bool(obj, "stream")
        prompt_key = "text" if obj.get("text") is not None else "input_ids"
        prompts, is_batch = (
            self._tokenize(obj["text"]) if prompt_key == "text" else self._check_ids(obj["input_ids"])
        )
        params, n = self._sampling_params(obj.get("sampling_params"), len(prompts), is_batch)
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            self._check_length(ids, sp, f"{prompt_key}[{i}]: " if is_batch else "", prompt_key)
        logprobs = self._logprob_options(obj, prompts, is_batch)
        priorities = self._priorities(obj, len(prompts), is_batch)
        routes = self._routed_experts_options(obj, prompts, is_batch)
        adapters = self._lora_paths(obj, len(prompts), is_batch)
        seeds = [self.resolve_seed(sp) for sp in params]
        # n > 1: copy j of prompt i is request i * n + j, seeded from the prompt's seed
        expand = [(i, j) for i in range(len(prompts)) for j in range(n)]
        rids = self._rids(obj.get("rid"), len(prompts), is_batch, busy_rids, n)
        reqs = [
            TokenizedGenerateReq(
                rid=rid,
                input_ids=prompts[i],
                sampling_params=params[i],
                seed=derived_seed(seeds[i], j),
                stream=stream,
                return_logprob=logprobs[i][0],
                top_logprobs_num=logprobs[i][1],
                logprob_start_len=logprobs[i][2],
                token_ids_logprob=logprobs[i][3],
                priority=priorities[i],
                return_routed_experts=routes[i][0],
                routed_experts_start_len=routes[i][1],
                lora_path=adapters[i],
            )
            for rid, (i, j) in zip(rids, expand)
        ]
        log_metrics = obj.get("log_metrics")
        if log_metrics is not None and not isinstance(log_metrics, bool):
            raise RequestError(f"log_metrics must be a boolean, got {log_metrics!r}", "log_metrics")
        return GenerateCall(
            reqs=reqs,
            is_batch=is_batch or n > 1,
            stream=stream,
            return_text_in_logprobs=_bool(obj, "return_text_in_logprobs"),
            return_prompt_token_ids=_bool(obj, "return_prompt_token_ids"),
            log_metrics=log_metrics is not False,
        )

    def _priorities(self, obj: dict[str, Any], n: int, is_batch: bool) -> list[int | None]:
        values = self._per_item(obj, "priority", None, n, is_batch)
        for value in values:
            if value is None:
                continue
            if not is_int(value) or abs(value) >= 2**63:
                raise RequestError(f"priority must be an integer, got {value!r}", "priority")
            if not self.priority_scheduling:
                raise RequestError(
                    "priority needs a server started with --enable-priority-scheduling (SGLang's flag)",
                    "priority",
                )
        return values

    def _lora_paths(self, obj: dict[str, Any], n: int, is_batch: bool) -> list[str | None]:
        """Each prompt's LoRA adapter by name (SGLang's lora_path: one, or one per prompt), or None."""
        names = self._per_item(obj, "lora_path", None, n, is_batch)
        for name in names:
            if name is None:
                continue
            if not isinstance(name, str):
                raise RequestError(f"lora_path must be an adapter's name, got {name!r}", "lora_path")
            if self.lora_names is None:
                raise RequestError(
                    "lora_path needs a server started with --enable-lora (or --lora-paths)", "lora_path"
                )
            if name not in self.lora_names:
                known = ", ".join(sorted(self.lora_names)) or "none"
                raise RequestError(
                    f"lora_path: no LoRA adapter named {name!r} (loaded: {known})", "lora_path"
                )
        return names

    def _check_length(self, ids: list[int], sp: SamplingParams, where: str, prompt_key: str) -> None:
        total = len(ids) + sp.max_new_tokens
        param = "max_new_tokens" if len(ids) < self.context_length else prompt_key
        if total > self.context_length:
            raise RequestError(
                f"{where}the prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                f"{total} exceeds the context length ({self.context_length})",
                param,
            )
        if self.max_total_tokens is not None and total > self.max_total_tokens:
            raise RequestError(
                f"{where}the prompt ({len(ids)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                f"{total} exceeds the KV cache capacity ({self.max_total_tokens} tokens)",
                param,
            )

    def _tokenize(self, text: Any) -> tuple[list[list[int]], bool]:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(
                "text must be a non-empty string or a non-empty list of non-empty strings", "text"
            )
        for i, t in enumerate(texts):
            where = f"text[{i}]" if is_batch else "text"
            if not t:
                raise RequestError(f"{where} is empty", "text")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    f"{where} contains an unpaired surrogate (not valid Unicode)", "text"
                ) from None
        prompts = [list(ids) for ids in self.tokenizer(texts)["input_ids"]]
        for i, ids in enumerate(prompts):
            where = f"text[{i}]" if is_batch else "text"
            if not ids:
                raise RequestError(f"{where} tokenizes to no tokens", "text")
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:  # a rank would index past its embedding and crash
                raise RequestError(
                    f"{where} tokenizes to id {outside[0]}, outside the model's vocabulary of "
                    f"{self.vocab_size}: the tokenizer does not match the model",
                    "text",
                )
        return prompts, is_batch

    def _check_ids(self, input_ids: Any) -> tuple[list[list[int]], bool]:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError(
                "input_ids must be a non-empty list of token ids (or a list of such lists)", "input_ids"
            )
        is_batch = isinstance(input_ids[0], list)
        rows = input_ids if is_batch else [input_ids]
        for i, row in enumerate(rows):
            where = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(row, list):
                raise RequestError(f"{where} must be a list of token ids", "input_ids")
            if not row:
                raise RequestError(f"{where} is empty", "input_ids")
            for token in row:
                if not is_token_id(token, self.vocab_size):
                    raise RequestError(
                        f"{where} holds {token!r}, not a token id in [0, {self.vocab_size})", "input_ids"
                    )
        return [list(row) for row in rows], is_batch

    def _sampling_params(self, raw: Any, n: int, is_batch: bool) -> tuple[list[SamplingParams], int]:
        """One SamplingParams per prompt, and `n` (copies per prompt: the same in every entry, as SGLang)."""
        if is_batch and isinstance(raw, list):
            if len(raw) != n:
                raise RequestError(
                    f"sampling_params has {len(raw)} entries for a batch of {n}", "sampling_params"
                )
            raws = raw
        else:
            raws = [raw] * n
        out, copies = [], set()
        for one in raws:
            for key, value in one.items() if isinstance(one, dict) else ():
                if isinstance(value, int) and abs(value) >= 2**63:  # JSON ints are unbounded; floats are not
                    raise RequestError(
                        f"{key} is out of range: {value!r:.30}", key if key in SAMPLING else "sampling_params"
                    )
            try:
                params = SamplingParams.from_dict(one)
                params.validate(self.vocab_size)
            except VocabularyError as error:
                raise RequestError(str(error), error.param) from None
            except (ValueError, TypeError) as error:
                name = str(error).split(" ", 1)[0]
                raise RequestError(str(error), name if name in SAMPLING else "sampling_params") from None
            self._check_grammar(params)
            out.append(params)
            copies.add(one.get("n") if isinstance(one, dict) else None)
        if len(copies) > 1:
            raise RequestError("n must be the same in every sampling_params entry of a batch", "n")
        count = copies.pop()
        if count is None:
            return out, 1
        if not is_int(count) or not 1 <= count <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {count!r}", "n")
        return out, int(count)

    def _check_grammar(self, params: SamplingParams) -> None:
        """A grammar is compiled here first, so one that does not compile is a 400 and never
        reaches a rank (where each rank compiles it again, from the compiler's cache)."""
        spec = params.grammar
        if spec is None:
            return
        if self.grammars is None:
            raise RequestError(f"{spec.kind} needs a grammar backend (--grammar-backend)", spec.kind)
        try:
            self.grammars.compile(spec)
        except GrammarError as error:
            raise RequestError(str(error), error.param) from None

    def _rids(self, raw: Any, prompts: int, is_batch: bool, busy_rids: Container[str], n: int) -> list[str]:
        """A request id per request: generated, or the client's (one per prompt; with n > 1 the
        copies of a prompt get its rid with -0, -1, ... appended)."""
        if raw is None:
            return [uuid.uuid4().hex for _ in range(prompts * n)]
        rids = raw if is_batch else [raw]
        if (
            not isinstance(rids, list)
            or len(rids) != prompts
            or not all(isinstance(r, str) and r for r in rids)
        ):
            shape = f"a list of {prompts} non-empty strings" if is_batch else "a non-empty string"
            raise RequestError(f"rid must be {shape}, got {raw!r}", "rid")
        if n > 1:
            rids = [f"{rid}-{j}" for rid in rids for j in range(n)]
        if len(set(rids)) != len(rids):
            raise RequestError("rid holds duplicates", "rid")
        busy = [r for r in rids if r in busy_rids]
        if busy:
            raise RequestError(f"rid {busy[0]!r} is already in flight", "rid")
        return list(rids)

    def _logprob_options(
        self, obj: dict[str, Any], prompts: list[list[int]], is_batch: bool
    ) -> list[tuple[bool, int, int, list[int] | None]]:
        """(return_logprob, top_logprobs_num, logprob_start_len, token_ids_logprob) per prompt. The
        last three matter only with return_logprob, as in SGLang."""
        n = len(prompts)
        wants = self._per_item(obj, "return_logprob", False, n, is_batch)
        tops = self._per_item(obj, "top_logprobs_num", 0, n, is_batch)
        starts = self._per_item(obj, "logprob_start_len", -1, n, is_batch)
        for i, (want, top, start, ids) in enumerate(zip(wants, tops, starts, prompts)):
            where = f"[{i}]" if is_batch else ""
            if not isinstance(want, bool):
                raise RequestError(f"return_logprob{where} must be a boolean, got {want!r}", "return_logprob")
            if not is_int(top) or not 0 <= top <= self.vocab_size:
                raise RequestError(
                    f"top_logprobs_num{where} must be an integer in [0, {self.vocab_size}], got {top!r}",
                    "top_logprobs_num",
                )
            if not is_int(start) or not -1 <= start < len(ids):
                raise RequestError(
                    f"logprob_start_len{where} must be -1 (output tokens only) or a prompt position "
                    f"in [0, {len(ids)}), got {start!r}",
                    "logprob_start_len",
                )
        ids_lists = self._token_ids_logprob(obj, n, is_batch)
        return [
            (want, top if want else 0, start if want else -1, ids if want else None)
            for want, top, start, ids in zip(wants, tops, starts, ids_lists)
        ]

    def _token_ids_logprob(self, obj: dict[str, Any], n: int, is_batch: bool) -> list[list[int] | None]:
        """SGLang's token_ids_logprob per prompt: the token ids whose logprobs every scored position
        reports, in the order given; a batch takes one list for all or one per prompt (null: none)."""
        value = obj.get("token_ids_logprob")
        if value is None:
            return [None] * n
        per_prompt = (
            is_batch and isinstance(value, list) and any(v is None or isinstance(v, list) for v in value)
        )
        if per_prompt and len(value) != n:
            raise RequestError(
                f"token_ids_logprob has {len(value)} entries for a batch of {n}", "token_ids_logprob"
            )
        lists = value if per_prompt else [value] * n
        for i, ids in enumerate(lists):
            where = f"[{i}]" if per_prompt else ""
            if ids is not None and (
                not isinstance(ids, list) or not ids or not all(is_token_id(t, self.vocab_size) for t in ids)
            ):
                raise RequestError(
                    f"token_ids_logprob{where} must be a non-empty list of token ids in "
                    f"[0, {self.vocab_size}), got {ids!r}",
                    "token_ids_logprob",
                )
        return [None if ids is None else list(ids) for ids in lists]

    def _routed_experts_options(
        self, obj: dict[str, Any], prompts: list[list[int]], is_batch: bool
    ) -> list[tuple[bool, int]]:
        """(return_routed_experts, routed_experts_start_len) per prompt, as SGLang takes them."""
        n = len(prompts)
        wants = self._per_item(obj, "return_routed_experts", False, n, is_batch)
        starts = self._per_item(obj, "routed_experts_start_len", 0, n, is_batch)
        for i, (want, start, ids) in enumerate(zip(wants, starts, prompts)):
            where = f"[{i}]" if is_batch else ""
            if not isinstance(want, bool):
                raise RequestError(
                    f"return_routed_experts{where} must be a boolean, got {want!r}", "return_routed_experts"
                )
            if want and not self.return_routed_experts:
                raise RequestError(
                    "return_routed_experts needs the server started with --enable-return-routed-experts",
                    "return_routed_experts",
                )
            if not is_int(start) or not 0 <= start <= len(ids):
                raise RequestError(
                    f"routed_experts_start_len{where} must be a prompt position in [0, {len(ids)}], got {start!r}",
                    "routed_experts_start_len",
                )
        return [(want, start if want else 0) for want, start in zip(wants, starts)]

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
