"""Who drafts, and how much: each request's draft length follows its acceptance; NGRAM drafts from
the request's own tokens, STANDALONE through a draft model (model_executor/drafter.py). What a
verify step does with the drafts: scheduler/speculative.py.

Draft lengths are functions of a request's tokens and of its accept counts so far, and so are n-gram
drafts (a draft model's are MIN-synced over TP below the line), so every rank drafts alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import consensus
from model_executor.drafter import Drafter
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


@dataclass
class ModelDraftState(DraftState):
    """A request's draft lengths and its row of the drafter's KV memory."""

    row: int | None = None  # None until it first drafts


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


class DraftSource:
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
        by the speculator (scheduler/grammar.py draft_matchers)."""
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


class NgramDrafts(DraftSource):
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


class ModelDrafts(DraftSource):
    """Greedy drafts of a draft model (`--speculative-algorithm STANDALONE`), each request through a
    row of its memory, taken when the request first drafts (none free: no drafts)."""

    def __init__(self, drafter: Drafter, num_draft_tokens: int) -> None:
        super().__init__(num_draft_tokens)
        self.drafter = drafter

    def new_state(self) -> DraftState:
        return ModelDraftState(max_drafts=self.max_drafts)

    def draft(self, reqs: list[Req], limits: list[int], budget: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        rooms = []
        for req, limit in zip(reqs, limits):
            # the row ends at the draft model's context: the request's tokens and all drafts but the last
            room = max(0, min(limit, budget, self.drafter.context_length - req.seq_len + 1))
            rooms.append(room)
            budget -= room
        rows: dict[int, int] = {}  # request -> its row, for the requests drafting
        for i, room in enumerate(rooms):
            if room > 0 and (row := self._row(reqs[i])) is not None:
                rows[i] = row
        if not rows:
            return out
        drafted = self.drafter.draft(
            list(rows.values()), [reqs[i].fill_ids for i in rows], [rooms[i] for i in rows]
        )
        for i, draft in zip(rows, drafted):
            out[i] = draft
        return out

    def _row(self, req: Req) -> int | None:
        """The request's row of the drafter's memory (taken now if it had none)."""
        state = self.states[req.rid]
        assert isinstance(state, ModelDraftState)
        if state.row is None:
            state.row = self.drafter.open_row()
        return state.row

    def forget(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if isinstance(state, ModelDraftState) and state.row is not None:
            self.drafter.close_row(state.row)
