"""Speculative decoding in the scheduler: drafts from each request's own tokens
(`--speculative-algorithm NGRAM`) or from a small model (STANDALONE: scheduler/draft_model.py),
checked in one decode step, accepted while they equal what plain decoding samples.

A verify step is a decode step with more rows. Request i, its last token t and its drafts
d1..dk, feeds k + 1 rows, each a decode row of its own:

    row j:  input (t, d1, ..., dk)[j] at position kv_len + j, attending over kv_len + j + 1 slots
            (the attention kernels write every row's K/V before any row reads), sampled at output
            position len(output_ids) + j with its penalties over output_ids + d1..dj

so row j computes exactly what a plain decode step would compute for that position had the
drafts before it been sampled (decode rows do not depend on their batch), and samples with the
same counter-based draw. The request takes the samples s0..sa while s(j-1) == dj: those are plain
decoding's tokens, at any temperature. The KV of rows past the last token taken is freed.

Every rank decides alike: draft lengths are functions of a request's tokens and of the accept counts
so far, and so are n-gram drafts (a draft model's are MIN-synced over TP); the sampled ids are
MIN-synced over TP (at tp > 1), and each request's (drafts, accepted) goes into the consensus
digest. A constrained request's row j is masked by a fork of its matcher past d1..dj; the
request's own matcher advances only on the tokens taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import consensus
from scheduler.req import Req

CANDIDATES = 16  # earlier occurrences of the last token tried, most recent first
MIN_MATCH = 3  # tokens a suffix must match before its continuation is drafted
MAX_PAUSE = 32  # decode steps a request drafts nothing after drafts kept failing


@dataclass
class DraftState:
    """How long one request's drafts may be now, whatever drafts them."""

    max_drafts: int = 0
    misses: int = 0  # verify steps in a row that accepted no draft
    pause: int = 0  # decode steps left without drafts


@dataclass
class NgramState(DraftState):
    """One request's n-gram index over its tokens, and its draft lengths."""

    positions: dict[int, list[int]] = field(default_factory=dict)  # token -> positions, ascending
    indexed: int = 0  # tokens indexed (every position but the last, whose successor is unknown)

    def index(self, tokens: list[int]) -> None:
        for p in range(self.indexed, len(tokens) - 1):
            self.positions.setdefault(tokens[p], []).append(p)
        self.indexed = max(self.indexed, len(tokens) - 1)


def ngram_draft(tokens: list[int], state: NgramState, max_len: int, max_match: int) -> list[int]:
    """Up to `max_len` tokens that followed the longest earlier match (at least MIN_MATCH tokens,
    at most `max_match`; the most recent of equal matches) of the tokens' suffix."""
    if max_len <= 0 or len(tokens) < 2:
        return []
    state.index(tokens)
    end = len(tokens) - 1
    best, best_len = -1, 0
    for p in reversed(state.positions.get(tokens[end], [])[-CANDIDATES:]):
        m = 1
        while m < max_match and p - m >= 0 and tokens[p - m] == tokens[end - m]:
            m += 1
        if m > best_len:
            best, best_len = p, m
            if m == max_match:
                break
    if best_len < MIN_MATCH:
        return []
    return tokens[best + 1 : best + 1 + max_len]


def accepted_tokens(drafts: list[int], samples: list[int]) -> list[int]:
    """The samples a request takes: s0, and s(j) while s(j-1) equalled draft j-1."""
    assert len(samples) == len(drafts) + 1
    n = 1
    while n <= len(drafts) and samples[n - 1] == drafts[n - 1]:
        n += 1
    return samples[:n]


class Speculator:
    """What every drafter shares: a step verifies at most `num_draft_tokens` rows in all, one per
    request first and the rest as drafts in batch order (past a few rows a decode step is bound by
    arithmetic rather than by reading the weights, and a draft row costs about what a request's row
    does: docs/performance.md), and each request's draft length follows its acceptance."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.max_drafts = num_draft_tokens - 1
        self.states: dict[str, DraftState] = {}

    def new_state(self) -> DraftState:
        return DraftState(max_drafts=self.max_drafts)

    def drafts(self, reqs: list[Req], context_length: int) -> list[list[int]]:
        """Each request's drafts, never past max_new_tokens or the context (the last row samples
        one more token than it drafts); a constrained request's are cut to what its grammar allows
        by the scheduler (scheduler/grammar.py draft_matchers)."""
        limits = []
        for req in reqs:
            state = self.states.get(req.rid)
            if state is None:
                state = self.states[req.rid] = self.new_state()
            limit = min(state.max_drafts, req.remaining_new_tokens - 1, context_length - req.seq_len - 1)
            if state.pause > 0:
                state.pause = max(state.pause - 1, 0)
                limit = 0
            limits.append(limit)
        return self.draft(reqs, limits, self.max_drafts + 1 - len(reqs))

    def draft(self, reqs: list[Req], limits: list[int], budget: int) -> list[list[int]]:
        """Up to limits[i] drafts for request i, `budget` in all (a drafter's own)."""
        raise NotImplementedError

    def verified(self, req: Req, drafts: list[int], taken: int) -> None:
        """Records a verify step of `req`: `taken` tokens taken (accepted drafts + 1). Draft lengths
        follow acceptance: all accepted doubles the next limit, a miss shrinks it to what was
        accepted plus one, and misses in a row pause drafting for 2, 4, .. MAX_PAUSE steps."""
        consensus.record("spec_verify", (req.rid, len(drafts), taken))
        if not drafts:
            return
        state = self.states[req.rid]
        accepted = taken - 1
        if accepted == len(drafts):
            state.max_drafts = min(self.max_drafts, max(2 * state.max_drafts, 1))
        else:
            state.max_drafts = max(accepted + 1, 1)
        if accepted == 0:
            state.misses += 1
            state.pause = min(2**state.misses, MAX_PAUSE)
        else:
            state.misses = 0

    def forget(self, rid: str) -> None:
        self.states.pop(rid, None)


class NgramSpeculator(Speculator):
    """Drafts from each request's own tokens (`--speculative-algorithm NGRAM`), `max_match` tokens
    matched at most."""

    def __init__(self, num_draft_tokens: int, max_match: int) -> None:
        super().__init__(num_draft_tokens)
        self.max_match = max_match

    def new_state(self) -> DraftState:
        return NgramState(max_drafts=self.max_drafts)

    def draft(self, reqs: list[Req], limits: list[int], budget: int) -> list[list[int]]:
        out = []
        for req, limit in zip(reqs, limits):
            state = self.states[req.rid]
            assert isinstance(state, NgramState)
            out.append(ngram_draft(req.fill_ids, state, min(limit, budget), self.max_match))
            budget -= len(out[-1])
        return out
