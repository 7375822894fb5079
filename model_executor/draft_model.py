"""The draft model of `--speculative-algorithm STANDALONE` (`--speculative-draft-model-path`): any
causal model with the target's tokenizer, run whole on every rank and decoded greedily.

Each token list being drafted for keeps a row in the draft model's own KV memory, holding the K/V of
the tokens fed so far. A call first brings each row up to its tokens: the K/V past their common
prefix (the drafts the last verify step rejected, or drafts it never verified) is trimmed, and the
tokens after it are fed in one step for every row (a decode step where each feeds one token, else
an extend). That step's logits give each row's first draft; the rest are decoded one step at a
time, the rows still drafting together. Verification (scheduler/speculative.py) keeps the outputs
those of plain decoding whatever the draft model proposes: it changes only how many tokens a step
takes.

Ranks draft alike: the lengths come from the scheduler's broadcast state and the draft memory's free
pages (its budget is agreed over the world as the target's is), and the drafted ids are MIN-synced
over TP, so a rank whose arithmetic differs (another CPU) verifies the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.parallel_state import ParallelState
from model_executor.drafter import Drafter
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner, RunnerConfig
from model_executor.sampling_inputs import SamplingInputs
from srt.server_args import ServerArgs
from srt.utils import resolve_dtype

NO_DRAFT = torch.iinfo(torch.int64).max  # a padded cell of the MIN-synced drafts


@dataclass
class DraftRow:
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the row holds, in order
    agreed: int = 0  # tokens known to be the list's own (its length when it last drafted)


class DraftModel(Drafter):
    """Greedy drafts of `runner` (the draft model), MIN-synced over `tp`; a drafted id outside the
    target's `vocab_size` ends a row's drafts."""

    def __init__(self, runner: ModelRunner, tp: Communicator, vocab_size: int) -> None:
        self.runner = runner
        self.memory = runner.memory
        self.tp = tp
        self.vocab_size = vocab_size
        self.context_length = runner.context_length
        self.rows: dict[int, DraftRow] = {}

    @classmethod
    def load(cls, args: ServerArgs, target: ModelRunner, parallel: ParallelState) -> DraftModel:
        """The draft model on this rank: whole (TP and PP of one), in the target's dtype, page size
        and request rows, with KV for the target's tokens plus a verify step's drafts per request
        (page rounded), budgeted over the world as the target's is so that every rank has the same
        pages."""
        assert args.speculative_draft_model_path is not None
        one = Communicator.single()
        rows = target.max_running_requests
        config = RunnerConfig(
            model_dir=Path(args.speculative_draft_model_path),
            dtype=resolve_dtype(args.dtype, args.device),
            device=args.device,
            page_size=args.page_size,
            mem_fraction_static=args.mem_fraction_static,
            max_total_tokens=target.max_total_tokens + rows * (args.num_draft_tokens + 2 * args.page_size),
            max_running_requests=rows,
            attention_backend=args.attention_backend,
            local_world_size=args.ranks_per_node if args.device == "cpu" else 1,
            deterministic=args.deterministic,
            disable_hybrid_swa_memory=True,  # a row keeps every position: no window to slide
            chunked_prefill_size=args.chunked_prefill_size,
            disable_cuda_graph=True,
            quantization=args.draft_quantization,
        )
        runner = ModelRunner(config, ParallelState(world=parallel.world, tp=one, pp=one))
        return cls(runner, parallel.tp, target.vocab_size)

    def open_row(self) -> int | None:
        row = self.memory.req_to_token_pool.alloc()
        if row is not None:
            self.rows[row] = DraftRow()
        return row

    def close_row(self, row: int) -> None:
        self._trim(row, 0)
        del self.rows[row]
        self.memory.req_to_token_pool.free(row)

    def draft(self, rows: list[int], tokens: list[list[int]], lengths: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        if not rows or not self._fits(rows, tokens, lengths):
            return out
        first = self._catch_up(rows, tokens)
        for k in range(len(rows)):
            out[k].append(first[k])
        for step in range(1, max(lengths)):
            active = [k for k, n in enumerate(lengths) if n > step]
            if not active:
                break
            ids = self._decode([rows[k] for k in active], [out[k][-1] for k in active])
            for k, token in zip(active, ids):
                out[k].append(token)
        return self._agreed(out)

    def _fits(self, rows: list[int], tokens: list[list[int]], lengths: list[int]) -> bool:
        """Trims each row to its tokens, then whether the pages for every draft are free."""
        prefix, seq = [], []
        for row, new, n in zip(rows, tokens, lengths):
            held = self.rows[row]
            keep = held.agreed
            while keep < min(len(held.tokens), len(new) - 1) and held.tokens[keep] == new[keep]:
                keep += 1
            self._trim(row, keep)
            prefix.append(keep)
            seq.append(len(new) + n - 1)
        return self.memory.allocator.pages_needed(prefix, seq) <= self.memory.allocator.num_free_pages

    def _trim(self, row: int, keep: int) -> None:
        """Frees the row's K/V past its first `keep` tokens (a partly kept page stays the row's)."""
        held = self.rows[row]
        self.memory.free_tail(row, keep, len(held.tokens))
        del held.tokens[keep:]

    def _catch_up(self, rows: list[int], tokens: list[list[int]]) -> list[int]:
        """Feeds each row's tokens past those it holds; each one's next token, greedy."""
        held = [self.rows[row] for row in rows]
        prefix = [len(h.tokens) for h in held]
        inputs = [new[p:] for new, p in zip(tokens, prefix)]
        seq = [p + len(fed) for p, fed in zip(prefix, inputs)]
        mode = ForwardMode.DECODE if all(len(fed) == 1 for fed in inputs) else ForwardMode.EXTEND
        ids = self._forward(mode, [t for fed in inputs for t in fed], rows, prefix, seq)
        for h, new, fed in zip(held, tokens, inputs):
            h.tokens += fed
            h.agreed = len(new)
        return ids

    def _decode(self, rows: list[int], inputs: list[int]) -> list[int]:
        held = [self.rows[row] for row in rows]
        prefix = [len(h.tokens) for h in held]
        ids = self._forward(ForwardMode.DECODE, inputs, rows, prefix, [p + 1 for p in prefix])
        for h, token in zip(held, inputs):
            h.tokens.append(token)
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
