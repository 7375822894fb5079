"""Constrained decoding: grammar backends behind one interface (base.py), picked by name."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from model_executor.constrained.base import GrammarBackend, GrammarError, JsonOptions, Matcher, bitmask_words
from srt.sampling_params import GRAMMAR_KINDS, GrammarSpec

if TYPE_CHECKING:  # the front end imports this; torch comes only with the first grammar (xgrammar)
    import torch

GRAMMAR_BACKENDS = ("xgrammar", "none")  # SGLang's --grammar-backend names srt has

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "GrammarBackend",
    "GrammarError",
    "GrammarSpec",
    "JsonOptions",
    "Matcher",
    "LazyGrammarBackend",
    "bitmask_words",
    "create_backend",
]


def create_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    json_options: JsonOptions | None = None,
) -> GrammarBackend:
    """The backend called `name` for this tokenizer; ValueError for "none" or an unknown name."""
    if name == "xgrammar":
        from model_executor.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, json_options or JsonOptions())
    raise ValueError(f"no grammar backend {name!r} (choose one of {', '.join(GRAMMAR_BACKENDS[:-1])})")


class LazyGrammarBackend:
    """The server's backend, built on the first grammar (building xgrammar's vocabulary table
    costs about half a second, which a server that never sees a grammar should not pay). The
    front end and every rank build it from the same tokenizer, so they agree on what compiles."""

    def __init__(
        self,
        name: str,
        tokenizer_loader: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Collection[int],
        json_options: JsonOptions | None = None,
    ) -> None:
        self.name = name
        self._tokenizer_loader = tokenizer_loader
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(sorted(stop_token_ids))
        self._json_options = json_options or JsonOptions()
        self._backend: GrammarBackend | None = None
        self._failure: str | None = None

    def get(self, param: str) -> GrammarBackend:
        """The backend; GrammarError naming `param` when the server has none or it cannot be built."""
        if self.name == "none":
            raise GrammarError(
                f"{param} needs a grammar backend; this server runs with --grammar-backend none", param
            )
        if self._backend is None and self._failure is None:
            try:
                self._backend = create_backend(
                    self.name,
                    self._tokenizer_loader(),
                    self._vocab_size,
                    self._stop_token_ids,
                    self._json_options,
                )
            except Exception as error:  # noqa: BLE001 - the reason goes into every such request's 400
                self._failure = f"{type(error).__name__}: {error}"
        if self._backend is None:
            raise GrammarError(
                f"{param}: the {self.name} grammar backend cannot serve this tokenizer ({self._failure})",
                param,
            )
        return self._backend

    def compile(self, spec: GrammarSpec) -> Any:
        return self.get(spec.kind).compile(spec)

    def new_matcher(self, spec: GrammarSpec, tokens: Sequence[int] = ()) -> Matcher:
        return self.get(spec.kind).new_matcher(spec, tokens)

    def mask_logits(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """A copy of `logits` with what the rows' grammars forbid at -inf (the raw logits stay for
        logprobs). Only after a matcher was built, so the backend exists."""
        assert self._backend is not None, "no matcher was built"
        out = logits.float().clone()
        self._backend.apply_bitmask_inplace(out, bitmask, rows)
        return out
