"""The grammar backend interface: what constrained decoding needs from a grammar library.

The front end compiles every grammar once to validate it (a bad one is a 400 naming its
parameter); every rank compiles it again, synchronously, when it applies the request's message,
so all ranks hold a ready matcher in the same iteration (compiling costs milliseconds and is
cached by source). A matcher is host state that each rank advances on its own from the same
tokens; `Matcher.state` is what the consensus checker digests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from srt.sampling_params import GrammarSpec

if TYPE_CHECKING:  # the front end imports this; torch comes only with the first grammar (xgrammar)
    import torch


class GrammarError(ValueError):
    """A grammar that does not compile (an HTTP 400); `param` names the sampling parameter."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class JsonOptions:
    """How JSON-schema grammars treat whitespace (SGLang's --constrained-json-* flags)."""

    any_whitespace: bool = True  # False: the compact form only
    max_whitespace_cnt: int | None = 12  # consecutive whitespace characters allowed (--constrained-json-*)

    @classmethod
    def of(cls, server_args: Any) -> JsonOptions:
        return cls(
            not server_args.constrained_json_disable_any_whitespace,
            server_args.constrained_json_max_whitespace_cnt,
        )


class Matcher(ABC):
    """One request's position in its grammar. Mutated only by `accept` and `rebuild`."""

    @abstractmethod
    def fork(self) -> Matcher:
        """An independent copy at the same position (a speculative step's draft rows)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row] (int32 words, bit i of word w is token
        32 w + i); mutates nothing else."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advances past `token`; False (and no change) when the grammar does not allow it."""

    @property
    @abstractmethod
    def terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: nothing more may follow."""

    @property
    @abstractmethod
    def accepted(self) -> int:
        """Tokens accepted since the last rebuild."""

    @abstractmethod
    def rebuild(self, tokens: Sequence[int]) -> None:
        """Back to the grammar's start, then accept `tokens` (the request's delivered output):
        raises RuntimeError naming the first token the grammar refuses."""

    @property
    def state(self) -> tuple[int, bool]:
        """What ranks must agree on: (tokens accepted, terminated)."""
        return self.accepted, self.terminated


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary (the model's logits width)."""

    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """A compiled grammar (opaque, cached by source); GrammarError naming spec.kind if invalid."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the grammar's start."""

    def apply_bitmask_inplace(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """-inf in logits[r] wherever bitmask[r] forbids a token, for r in rows (the sampler's
        reference implementation unless the backend has a kernel that gives the same)."""
        from model_executor.sampler import apply_token_bitmask

        apply_token_bitmask(logits, bitmask, rows)

    def new_matcher(self, spec: GrammarSpec, tokens: Sequence[int] = ()) -> Matcher:
        matcher = self.matcher(self.compile(spec))
        if tokens:
            matcher.rebuild(tokens)
        return matcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
