"""Per-request sampling parameters, validated where they are built (bad input -> ValueError that
names the parameter; the HTTP layer turns it into a 400)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

_FIELDS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
           "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "seed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # no stop (EOS, stop ids or strings) before this many tokens; EOS and stop ids masked
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # minus this x how often a token was generated (OpenAI's, -2..2)
    presence_penalty: float = 0.0  # minus this once a token was generated (OpenAI's, -2..2)
    repetition_penalty: float = 1.0  # a token of the prompt or output: logit / p if > 0, else x p (> 0, <= 2)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @classmethod
    def from_dict(cls, raw: Any) -> SamplingParams:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError("sampling_params must be a JSON object")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise ValueError(f"sampling_params: unknown parameter(s) {', '.join(unknown)}")
        values = {k: v for k, v in raw.items() if v is not None}
        return cls(**values)

    def validate(self, vocab_size: int | None = None) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be an integer in [0, max_new_tokens ({self.max_new_tokens})], "
                             f"got {self.min_new_tokens!r}")
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
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def banned_ids(self, generated: int, eos_token_ids: Collection[int]) -> list[int]:
        """The ids the next token may not be, `generated` tokens in: before min_new_tokens, the
        ones that would stop the request (EOS unless ignored, stop_token_ids); else none."""
        if generated >= self.min_new_tokens:
            return []
        return sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids)))

    @property
    def penalties(self) -> tuple[float, float, float] | None:
        """(frequency, presence, repetition) where any is on, else None."""
        if self.frequency_penalty == 0 and self.presence_penalty == 0 and self.repetition_penalty == 1:
            return None
        return float(self.frequency_penalty), float(self.presence_penalty), float(self.repetition_penalty)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
