"""Per-request sampling parameters, validated where they are built (bad input -> ValueError that
names the parameter; the HTTP layer turns it into a 400)."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from srt.request_fields import SAMPLING, check_fields

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # SGLang's sampling_params names


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar, what model_executor/constrained compiles."""

    kind: str  # one of GRAMMAR_KINDS
    source: (
        str  # the grammar as the client sent it (a JSON schema serialized, a regex, EBNF, a structural tag)
    )

    def __post_init__(self) -> None:
        assert self.kind in GRAMMAR_KINDS, self.kind


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = (
        0  # no stop (EOS, stop ids or strings) before this many tokens; EOS and stop ids masked
    )
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # minus this x how often a token was generated (OpenAI's, -2..2)
    presence_penalty: float = 0.0  # minus this once a token was generated (OpenAI's, -2..2)
    repetition_penalty: float = 1.0  # a token of the prompt or output: logit / p if > 0, else x p (> 0, <= 2)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)  # a match in the output text ends the request
    ignore_eos: bool = False
    seed: int | None = None  # SGLang's sampling_seed
    skip_special_tokens: bool = True  # the text leaves special tokens out
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # the text keeps the stop string or stop token that ended the request
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # constrained decoding (at most one; SGLang's names): the output follows this grammar
    json_schema: str | None = None  # a JSON schema, serialized
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # xgrammar's structural tag, serialized

    def __post_init__(self) -> None:
        for kind in GRAMMAR_KINDS:  # as SGLang: an empty grammar is no grammar
            if getattr(self, kind) == "":
                setattr(self, kind, None)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _token_keys(self.logit_bias)
        self.validate()

    @classmethod
    def from_dict(cls, raw: Any) -> SamplingParams:
        """From SGLang's sampling_params object (`n` is the caller's: it fans a request out)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError("sampling_params must be a JSON object")
        check_fields(raw, SAMPLING)
        values = {
            k: v for k, v in raw.items() if v is not None and k != "n" and SAMPLING[k].kind == "implemented"
        }
        seed, sampling_seed = values.pop("seed", None), values.pop("sampling_seed", None)
        if seed is not None and sampling_seed is not None and seed != sampling_seed:
            raise ValueError(f"sampling_seed ({sampling_seed!r}) and seed ({seed!r}) differ: give one")
        return cls(**values, seed=sampling_seed if sampling_seed is not None else seed)

    def validate(self, vocab_size: int | None = None) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, max_new_tokens ({self.max_new_tokens})], "
                f"got {self.min_new_tokens!r}"
            )
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be token ids in [0, {vocab_size}), got {self.stop_token_ids!r}"
            )
        if not isinstance(self.stop_regex, list) or not all(
            isinstance(s, str) and s for s in self.stop_regex
        ):
            raise ValueError("stop_regex must be a non-empty string or a list of them")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except (re.error, RecursionError) as error:
                raise ValueError(
                    f"stop_regex {pattern!r} is not a valid regular expression: {error}"
                ) from None
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in given:
            if not isinstance(getattr(self, kind), str):
                raise ValueError(
                    f"{kind} must be a string, got {type(getattr(self, kind)).__name__}"
                    + (" (serialize the schema: json.dumps)" if kind != "regex" else "")
                )
        if len(given) > 1:
            raise ValueError(
                f"{given[1]} and {given[0]} are both set: give at most one of {', '.join(GRAMMAR_KINDS)}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be an object of token id -> bias, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"logit_bias keys must be token ids in {bound}, got {token!r}")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r} for token {token}"
                )

    def banned_ids(self, generated: int, eos_token_ids: Collection[int]) -> list[int]:
        """The ids the next token may not be, `generated` tokens in: before min_new_tokens, the
        ones that would stop the request (EOS unless ignored, stop_token_ids); else none."""
        if generated >= self.min_new_tokens:
            return []
        return sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids)))

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must follow, if any."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return GrammarSpec(kind, source)
        return None

    @property
    def stop_regex_window(self) -> int | None:
        """Output tokens whose text holds any match of the stop regexes that ends at the last token
        (as stop strings: a token is at least one character); None when a pattern is unbounded."""
        widest = 0
        for pattern in self.stop_regex:
            width = _max_width(pattern)
            if width is None:
                return None
            widest = max(widest, width)
        return widest + 2

    @property
    def penalties(self) -> tuple[float, float, float] | None:
        """(frequency, presence, repetition) where any is on, else None."""
        if self.frequency_penalty == 0 and self.presence_penalty == 0 and self.repetition_penalty == 1:
            return None
        return float(self.frequency_penalty), float(self.presence_penalty), float(self.repetition_penalty)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _token_keys(bias: dict[Any, Any]) -> dict[Any, Any]:
    """JSON object keys are strings: OpenAI's and SGLang's logit_bias keys are token ids as strings."""
    out: dict[Any, Any] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        out[key] = value
    return out


def _max_width(pattern: str) -> int | None:
    """The most characters a match of `pattern` can span; None when unbounded."""
    try:
        import re._parser as sre_parse
    except ImportError:  # Python 3.10
        import sre_parse
    width = sre_parse.parse(pattern).getwidth()[1]
    return None if width >= sre_parse.MAXREPEAT else int(width)
