"""What crosses the line between the scheduler and the model runner in one step, besides the
forward batch: how to turn the step's logits into next ids (SamplingInputs), and what comes back
(StepOutput).

The scheduler builds SamplingInputs from its requests, identically on every rank; the runner does
the rest below the line: logits processing (penalties, logit bias, banned ids, grammar masks),
sampling, the TP token-id sync, the hand-off of ids to earlier pipeline stages and the logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from model_executor.constrained import LazyGrammarBackend, Matcher
from model_executor.logprobs import TopLogprobs
from model_executor.sampler import SamplingBatchInfo


@dataclass
class LogprobRows:
    """The logprobs a step scores. Every rank passes the same `token_rows` to the forward (the LM
    head that turns them into logits is a TP collective); only where `compute` (the output rank)
    are log-softmaxes taken."""

    token_rows: list[int]  # rows of the step's flattened new tokens whose logits prompt logprobs need
    prompt_targets: list[int]  # the token each of token_rows scores (the prompt's next token)
    sampled_rows: list[int]  # requests whose sampled token is scored (rows of the last-token logits)
    top_nums: list[int]  # top alternatives per scored row: sampled_rows first, then token_rows
    compute: bool
    # token_ids_logprob per scored row, in top_nums' order (None: none asked); empty: no row asked
    id_lists: list[list[int] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.prompt_targets) == len(self.token_rows)
        assert len(self.top_nums) == len(self.sampled_rows) + len(self.token_rows)
        assert not self.id_lists or len(self.id_lists) == len(self.top_nums)


@dataclass
class SamplingInputs:
    """Per-request settings of one step's sampling, a row per request of the batch."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    seeds: list[int]
    output_positions: list[int]  # 0 for a request's first generated token
    penalties: list[tuple[float, float, float] | None]  # (frequency, presence, repetition)
    output_ids: list[list[int]]  # what each request generated so far (penalties read it)
    prompt_ids: list[list[int]]
    logit_biases: list[Mapping[int, float]]
    banned_ids: list[list[int]]  # e.g. EOS and stop ids before min_new_tokens
    grammars: list[Matcher | None] = field(default_factory=list)  # empty: no constrained request
    grammar_backend: LazyGrammarBackend | None = None  # applies the grammars' bitmasks
    logprobs: LogprobRows | None = None
    sync_across_tp: bool = False  # MIN-all-reduce the sampled ids over TP (a scheduling decision)
    # A test's fault injection: changes this rank's ids after sampling, before the TP sync.
    corrupt_ids: Callable[[torch.Tensor], None] | None = None

    @classmethod
    def greedy(cls, batch_size: int) -> SamplingInputs:
        """Argmax for every row, nothing else (benchmarks and tests)."""
        n = batch_size
        return cls(
            [0.0] * n, [1.0] * n, [-1] * n, [0.0] * n, [0] * n, [0] * n,
            [None] * n, [[]] * n, [[]] * n, [{}] * n, [[]] * n,
        )  # fmt: skip

    @property
    def batch_size(self) -> int:
        return len(self.temperatures)

    @property
    def constrained_rows(self) -> list[int]:
        return [i for i, grammar in enumerate(self.grammars) if grammar is not None]

    def batch_info(self, device: torch.device | str) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_lists(
            temperatures=self.temperatures,
            top_ps=self.top_ps,
            top_ks=self.top_ks,
            min_ps=self.min_ps,
            seeds=self.seeds,
            output_positions=self.output_positions,
            device=device,
        )


@dataclass
class ScoredTokens:
    """Logprobs of one step, rows as LogprobRows orders them: each sampled row's token, then each
    prompt row's target."""

    values: list[float]
    token_ids: list[int]
    tops: list[TopLogprobs | None]
    ids: list[TopLogprobs | None] = field(default_factory=list)  # LogprobRows.id_lists' logprobs


@dataclass
class StepOutput:
    next_ids: list[int]  # a row per request of the batch (a mid-prompt chunk's is meaningless)
    logprobs: ScoredTokens | None = None  # where LogprobRows.compute
    embeddings: list[list[float]] | None = None  # --is-embedding: each prompt's, pooled (no id sampled)
