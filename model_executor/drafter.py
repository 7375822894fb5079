"""What the scheduler asks of a draft model (`--speculative-algorithm STANDALONE`): greedy
continuations of token lists. The scheduler reaches the draft model only through this interface
(an import contract keeps `scheduler/` from importing model_executor/draft_model.py), as it reaches
the target model only through the runner's step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from model_executor.distributed.parallel_state import ParallelState
from model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


class Drafter(ABC):
    """Drafts with a model of its own. Each token list being drafted for keeps a row of the
    drafter's KV memory; a row's token list only grows between calls, but for the drafts the last
    verify step rejected, which `draft` trims."""

    context_length: int  # the longest a row may grow: its tokens and all drafts but the last

    @abstractmethod
    def open_row(self) -> int | None:
        """Takes a free row (holding no tokens) of the drafter's memory; None when all are taken."""

    @abstractmethod
    def close_row(self, row: int) -> None:
        """Frees the row and every KV page it holds."""

    @abstractmethod
    def draft(self, rows: list[int], tokens: list[list[int]], lengths: list[int]) -> list[list[int]]:
        """lengths[i] >= 1 greedy tokens after tokens[i], fed through rows[i]: the row's KV is first
        trimmed to the common prefix of what it held and tokens[i], then brought up to tokens[i] (and
        holds the drafts after, but the last). Every list is empty, and no row has grown, when their
        pages do not all fit in the free memory (decided from the tokens and the memory's agreed
        budget: alike on every rank). The drafts are MIN-synced over TP, so every TP rank returns
        the same, each cut at its first id outside the target's vocabulary: every TP rank calls it
        with the same arguments."""


def load_drafter(args: ServerArgs, target: ModelRunner, parallel: ParallelState) -> Drafter:
    """The draft model of `--speculative-draft-model-path` on this rank."""
    from model_executor.draft_model import DraftModel  # the one implementation, loaded when asked for

    return DraftModel.load(args, target, parallel)
