"""From one step's float32 logits to what is sampled from, and the step's logprobs.

Order (vLLM's): penalties, logit bias, banned ids, grammar masks; each a copy where it changes
anything, so the raw logits stay for the logprobs (SGLang's default: temperature-independent).
Every step is a pure function of the requests' own tokens, so every rank computes the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_executor.constrained import Matcher, bitmask_words
from model_executor.logprobs import token_logprobs
from model_executor.sampler import apply_logit_bias, apply_penalties, ban_tokens
from model_executor.sampling_inputs import LogprobRows, SamplingInputs, ScoredTokens


def process_logits(logits: torch.Tensor, inputs: SamplingInputs, vocab_size: int) -> torch.Tensor:
    """The logits to sample from: `logits` itself when no request changes them."""
    out = apply_penalties(logits, inputs.penalties, inputs.output_ids, inputs.prompt_ids)
    out = apply_logit_bias(out, inputs.logit_biases)
    out = ban_tokens(out, inputs.banned_ids)
    rows = inputs.constrained_rows
    if rows:
        assert inputs.grammar_backend is not None, "a constrained row without its backend"
        out = inputs.grammar_backend.mask_logits(out, fill_bitmask(inputs.grammars, rows, vocab_size), rows)
    return out


def fill_bitmask(grammars: Sequence[Matcher | None], rows: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(grammars), ceil(vocab / 32)] int32: the tokens each of `rows` may take next (the other
    rows allow everything)."""
    bitmask = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i in rows:
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill_bitmask(bitmask, i)
    return bitmask


def score_tokens(
    rows: LogprobRows, last_logits: torch.Tensor, token_logits: torch.Tensor | None, next_ids: list[int]
) -> ScoredTokens | None:
    """The logprobs of each sampled row's token, then of each prompt row's target (from the raw
    logits); None when no row is scored."""
    targets = [next_ids[i] for i in rows.sampled_rows] + rows.prompt_targets
    if not targets:
        return None
    logits = last_logits[rows.sampled_rows]
    if token_logits is not None and token_logits.shape[0]:
        logits = torch.cat([logits, token_logits])
    values, tops, ids = token_logprobs(
        logits, torch.tensor(targets, device=logits.device), rows.top_nums, rows.id_lists
    )
    return ScoredTokens(values, targets, tops, ids)
