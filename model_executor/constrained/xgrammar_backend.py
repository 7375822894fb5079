"""xgrammar (the default, as in SGLang): JSON schemas, regexes, EBNF and structural tags compiled
against the tokenizer's vocabulary into token-level matchers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from model_executor.constrained.base import GrammarBackend, GrammarError, JsonOptions, Matcher
from srt.sampling_params import GrammarSpec

_WHAT = {
    "json_schema": "a valid JSON schema",
    "regex": "a valid regular expression",
    "ebnf": "a valid EBNF grammar",
    "structural_tag": "a valid structural tag",
}


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._accepted = 0

    def fork(self) -> Matcher:
        copy = XGrammarMatcher.__new__(XGrammarMatcher)
        copy._matcher, copy._accepted = self._matcher.fork(), self._accepted
        return copy

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            return False
        self._accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    @property
    def accepted(self) -> int:
        return self._accepted

    def rebuild(self, tokens: Sequence[int]) -> None:
        self._matcher.reset()
        self._accepted = 0
        for i, token in enumerate(tokens):
            if not self.accept(token):
                raise RuntimeError(f"the grammar refuses delivered token {i} (id {token})")


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], json_options: JsonOptions
    ) -> None:
        import xgrammar

        self._json = json_options
        self._xgr = xgrammar
        # the model's EOS ids end a grammar; without any, xgrammar takes the tokenizer's
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        # one thread: the ranks' torch threads already own the cores
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                json.loads(spec.source)  # xgrammar's own message for bad JSON is a C++ check
                return self._compiler.compile_json_schema(
                    spec.source,
                    any_whitespace=self._json.any_whitespace,
                    max_whitespace_cnt=self._json.max_whitespace_cnt,
                )
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return self._compiler.compile_grammar(spec.source)
            return self._compiler.compile_structural_tag(spec.source)
        except (
            RuntimeError,
            ValueError,
            TypeError,
            self._xgr.InvalidJSONError,
            self._xgr.InvalidStructuralTagError,
        ) as error:
            detail = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise GrammarError(
                f"{spec.kind} is not {_WHAT[spec.kind]}: {_clean(detail)}", spec.kind
            ) from None

    def matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(compiled)

    def apply_bitmask_inplace(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if logits.dtype != torch.float32 or not logits.is_contiguous():
            return super().apply_bitmask_inplace(logits, bitmask, rows)
        # its CPU / CUDA kernel: the same -inf entries as the sampler's tensor ops, several times faster
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=list(rows)
        )


def _clean(detail: str) -> str:
    """xgrammar's messages start with '[hh:mm:ss] /project/cpp/file.cc:123: '; keep what follows."""
    if detail.startswith("[") and ".cc:" in detail:
        detail = detail.split(".cc:", 1)[1].split(": ", 1)[-1]
    return detail
