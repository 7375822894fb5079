"""Drafts from a small model (`--speculative-algorithm STANDALONE --speculative-draft-model-path`):
any causal model with the target's tokenizer, run whole on every rank and decoded greedily.

Each request keeps a row in the draft model's own KV memory, holding the K/V of the tokens it fed
the draft model so far. A step first brings that row up to the request's tokens: the K/V past their
common prefix (the drafts the last verify step rejected, or drafts it never verified) is trimmed,
and the tokens after it are fed in one step for every drafting request (a decode step where each
feeds one token, else an extend). That step's logits give each request's first draft; the rest
are decoded one step at a time, the requests still drafting together. Verification
(scheduler/speculative.py) keeps the outputs those of plain decoding whatever the draft model
proposes: a draft model changes only how many tokens a step takes.

Ranks draft alike: a request's draft length comes from the broadcast state and the draft memory's
free pages (its budget is agreed over the world as the target's is), and the drafted ids are
MIN-synced over TP, so a rank whose arithmetic differs (another CPU) verifies the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.parallel_state import ParallelState
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner, RunnerConfig
from model_executor.sampling_inputs import SamplingInputs
from scheduler.req import Req
from scheduler.speculative import DraftState, Speculator
from srt.server_args import ServerArgs
from srt.utils import resolve_dtype

NO_DRAFT = torch.iinfo(torch.int64).max  # a padded cell of the MIN-synced drafts


@dataclass
class DraftModelState(DraftState):
    """A request's draft lengths and its row of the draft model's KV memory."""

    row: int | None = None  # in the draft memory's request table; None until it first drafts
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the row holds, in order
    agreed: int = 0  # tokens known to be the request's own (its length when it last drafted)


def draft_runner(args: ServerArgs, target: ModelRunner, parallel: ParallelState) -> ModelRunner:
    """The draft model on this rank: whole (TP and PP of one), in the target's dtype, page size and
    request rows, with KV for the target's tokens plus a verify step's drafts per request (page
    rounded), budgeted over the world as the target's is so that every rank has the same pages."""
    assert args.speculative_draft_model_path is not None
    one = Communicator.single()
    info = target.info()
    rows = int(info["max_running_requests"])
    config = RunnerConfig(
        model_dir=Path(args.speculative_draft_model_path),
        dtype=resolve_dtype(args.dtype, args.device),
        device=args.device,
        page_size=args.page_size,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=int(info["max_total_tokens"]) + rows * (args.num_draft_tokens + 2 * args.page_size),
        max_running_requests=rows,
        attention_backend=args.attention_backend,
        local_world_size=args.ranks_per_node if args.device == "cpu" else 1,
        deterministic=args.deterministic,
        disable_hybrid_swa_memory=True,  # a request's row keeps every position: no window to slide
        chunked_prefill_size=args.chunked_prefill_size,
        disable_cuda_graph=True,
    )
    return ModelRunner(config, ParallelState(world=parallel.world, tp=one, pp=one))


class DraftModelSpeculator(Speculator):
    """Greedy drafts of `runner` (the draft model), MIN-synced over `tp`; a drafted id outside the
    target's `vocab_size` ends a request's drafts."""

    def __init__(self, runner: ModelRunner, num_draft_tokens: int, tp: Communicator, vocab_size: int) -> None:
        super().__init__(num_draft_tokens)
        self.runner = runner
        self.memory = runner.memory
        self.tp = tp
        self.vocab_size = vocab_size
        self.context_length = int(runner.info()["context_length"])

    def new_state(self) -> DraftState:
        return DraftModelState(max_drafts=self.max_drafts)

    def draft(self, reqs: list[Req], limits: list[int], budget: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        rooms = []
        for req, limit in zip(reqs, limits):
            # the row ends at the draft model's context: the request's tokens and all drafts but the last
            room = max(0, min(limit, budget, self.context_length - req.seq_len + 1))
            rooms.append(room)
            budget -= room
        drafting = [i for i, room in enumerate(rooms) if room > 0 and self._ready(reqs[i])]
        if not drafting or not self._fits([reqs[i] for i in drafting], [rooms[i] for i in drafting]):
            return out
        states = [self._state(reqs[i]) for i in drafting]
        first = self._catch_up([reqs[i] for i in drafting], states)
        for k, i in enumerate(drafting):
            out[i].append(first[k])
        for step in range(1, max(rooms)):
            active = [k for k, i in enumerate(drafting) if rooms[i] > step]
            if not active:
                break
            ids = self._decode([states[k] for k in active], [out[drafting[k]][-1] for k in active])
            for k, token in zip(active, ids):
                out[drafting[k]].append(token)
        return self._agreed(out)

    def _state(self, req: Req) -> DraftModelState:
        state = self.states[req.rid]
        assert isinstance(state, DraftModelState)
        return state

    def _ready(self, req: Req) -> bool:
        """Whether the request has its row (taken now if it had none; none free: no drafts)."""
        state = self._state(req)
        if state.row is None:
            state.row = self.memory.req_to_token_pool.alloc()
        return state.row is not None

    def _fits(self, reqs: list[Req], rooms: list[int]) -> bool:
        """Trims each row to its request's tokens, then whether the pages for every draft are free
        (decided on the broadcast state and the agreed budget: alike on every rank)."""
        prefix, seq = [], []
        for req, room in zip(reqs, rooms):
            state = self._state(req)
            tokens = req.fill_ids
            keep = state.agreed
            while keep < min(len(state.tokens), len(tokens) - 1) and state.tokens[keep] == tokens[keep]:
                keep += 1
            self._trim(state, keep)
            prefix.append(keep)
            seq.append(len(tokens) + room - 1)
        return self.memory.allocator.pages_needed(prefix, seq) <= self.memory.allocator.num_free_pages

    def _trim(self, state: DraftModelState, keep: int) -> None:
        """Frees the row's K/V past its first `keep` tokens (a partly kept page stays the row's)."""
        self.memory.free_tail(state.row, keep, len(state.tokens))  # type: ignore[arg-type]
        del state.tokens[keep:]

    def _catch_up(self, reqs: list[Req], states: list[DraftModelState]) -> list[int]:
        """Feeds each request's tokens past its row's; each one's next token, greedy."""
        rows = [s.row for s in states]
        prefix = [len(s.tokens) for s in states]
        inputs = [req.fill_ids[len(s.tokens) :] for req, s in zip(reqs, states)]
        seq = [p + len(new) for p, new in zip(prefix, inputs)]
        mode = ForwardMode.DECODE if all(len(new) == 1 for new in inputs) else ForwardMode.EXTEND
        ids = self._forward(mode, [t for new in inputs for t in new], rows, prefix, seq)  # type: ignore[arg-type]
        for req, state, new in zip(reqs, states, inputs):
            state.tokens += new
            state.agreed = len(req.fill_ids)
        return ids

    def _decode(self, states: list[DraftModelState], inputs: list[int]) -> list[int]:
        rows = [s.row for s in states]
        prefix = [len(s.tokens) for s in states]
        ids = self._forward(ForwardMode.DECODE, inputs, rows, prefix, [p + 1 for p in prefix])  # type: ignore[arg-type]
        for state, token in zip(states, inputs):
            state.tokens.append(token)
        return ids

    def _forward(
        self, mode: ForwardMode, inputs: list[int], rows: list[int], prefix: list[int], seq: list[int]
    ) -> list[int]:
        slots = self.memory.alloc_extend(rows, prefix, seq)
        assert slots is not None, "the draft pages were checked"
        batch = make_forward_batch(mode, inputs, rows, prefix, seq, slots, self.runner.device)
        out = self.runner.step(batch, SamplingInputs.greedy(len(rows)))
        assert out is not None, "the draft model runs whole"
        return out.next_ids

    def _agreed(self, drafts: list[list[int]]) -> list[list[int]]:
        """The drafts MIN-synced over TP (their lengths agree already), each cut at its first id
        outside the target's vocabulary."""
        if self.tp.world_size > 1 and any(drafts):
            width = max(map(len, drafts))
            table = torch.full((len(drafts), width), NO_DRAFT, dtype=torch.int64)
            for i, draft in enumerate(drafts):
                table[i, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
            synced = self.tp.all_reduce(table.to(self.runner.device), op=torch.distributed.ReduceOp.MIN).cpu()
            drafts = [synced[i, : len(draft)].tolist() for i, draft in enumerate(drafts)]
        out = []
        for draft in drafts:
            cut = next((j for j, token in enumerate(draft) if token >= self.vocab_size), len(draft))
            out.append(draft[:cut])
        return out

    def forget(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if isinstance(state, DraftModelState) and state.row is not None:
            self._trim(state, 0)
            self.memory.req_to_token_pool.free(state.row)
