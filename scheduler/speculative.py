"""Speculative decoding's one seam in the scheduler: the speculator plans a verify step (its rows,
its forward batch, how each request takes its samples), the batch carries it as `batch.verify`,
and the scheduler runs it as it runs any batch. A plain step carries none and runs none of this.
Who drafts: scheduler/drafts.py.

A verify step is a decode step with more rows. Request i, its last token t and its drafts
d1..dk, feeds k + 1 rows, each a decode row of its own:

    row j:  input (t, d1, ..., dk)[j] at position kv_len + j, attending over kv_len + j + 1 slots
            (the attention kernels write every row's K/V before any row reads), sampled at output
            position len(output_ids) + j with its penalties over output_ids + d1..dj

so row j computes exactly what a plain decode step would compute for that position had the
drafts before it been sampled (decode rows do not depend on their batch), and samples with the
same counter-based draw. The request takes the samples s0..sa while s(j-1) == dj: those are plain
decoding's tokens, at any temperature. The KV of rows past the last token taken is freed.

Every rank decides alike: the drafts are (scheduler/drafts.py); the sampled ids are MIN-synced over
TP (at tp > 1), and each request's (drafts, accepted) goes into the consensus digest. A constrained
request's row j is masked by a fork of its matcher past d1..dj; the request's own matcher advances
only on the tokens taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_executor.constrained import Matcher
from model_executor.distributed.parallel_state import ParallelState
from model_executor.drafter import load_drafter
from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner
from scheduler.drafts import DraftSource, ModelDrafts, NgramDrafts
from scheduler.grammar import draft_matchers
from scheduler.kv_manager import KVManager
from scheduler.req import Req
from scheduler.schedule_batch import ScheduleBatch
from scheduler.stats import SchedulerStats
from srt.server_args import ServerArgs


def accepted_tokens(drafts: list[int], samples: list[int]) -> list[int]:
    """The samples a request takes: s0, and s(j) while s(j-1) equalled draft j-1."""
    assert len(samples) == len(drafts) + 1
    n = 1
    while n <= len(drafts) and samples[n - 1] == drafts[n - 1]:
        n += 1
    return samples[:n]


@dataclass
class VerifyInput:
    """A planned verify step: each request's drafts, and with a constrained request in the batch
    the matchers of each request's draft rows (draft_matchers), else []."""

    reqs: list[Req]  # the batch's
    drafts: list[list[int]]
    forks: list[list[Matcher]]

    @property
    def row_lens(self) -> list[int]:
        """The rows (tokens fed, ids sampled) of each request: its last token and its drafts."""
        return [1 + len(draft) for draft in self.drafts]

    @property
    def num_rows(self) -> int:
        return sum(self.row_lens)

    def rows(self) -> ScheduleBatch:
        """The rows as a decode batch of their own, request i repeated once per row (its logprob
        rows are planned and recorded over it)."""
        reqs = [req for req, n in zip(self.reqs, self.row_lens) for _ in range(n)]
        return ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs))

    def forward_batch(self, out_cache_loc: torch.Tensor, device: torch.device) -> ForwardBatch:
        """Each request's last token and drafts, a decode row each: row j at position kv_len + j."""
        input_ids: list[int] = []
        rows: list[int] = []
        prefix_lens: list[int] = []
        prompts: list[int] = []
        for req, draft in zip(self.reqs, self.drafts):
            assert req.req_pool_idx is not None
            input_ids += [req.output_ids[-1], *draft]
            rows += [req.req_pool_idx] * (1 + len(draft))
            prefix_lens += range(req.kv_len, req.kv_len + 1 + len(draft))
            prompts += [len(req.origin_input_ids)] * (1 + len(draft))
        seq_lens = [p + 1 for p in prefix_lens]
        return make_forward_batch(
            ForwardMode.DECODE, input_ids, rows, prefix_lens, seq_lens, out_cache_loc, device, prompts
        )

    def sampling_rows(self) -> tuple[list[Req], list[list[int]], list[Matcher | None]]:
        """Each row's request, the output it samples after (row j: output_ids + d1..dj, as plain
        decoding would have had them: penalties, min_new_tokens, the output position) and its
        matcher (row j's: the fork past d1..dj)."""
        reqs: list[Req] = []
        outputs: list[list[int]] = []
        grammars: list[Matcher | None] = []
        forks = self.forks or [[] for _ in self.drafts]
        for req, draft, fork in zip(self.reqs, self.drafts, forks):
            reqs += [req] * (1 + len(draft))
            outputs += [req.output_ids + draft[:j] if j else req.output_ids for j in range(1 + len(draft))]
            grammars += [req.grammar, *fork] if req.grammar is not None else [None] * (1 + len(draft))
        assert len(grammars) == len(reqs)
        return reqs, outputs, grammars

    def accepted(self, next_ids: list[int]) -> list[list[int]]:
        """The tokens each request takes from its rows' samples (accepted_tokens)."""
        out, row = [], 0
        for draft in self.drafts:
            out.append(accepted_tokens(draft, [int(t) for t in next_ids[row : row + 1 + len(draft)]]))
            row += 1 + len(draft)
        return out


class Speculator:
    """Plans each decode step's verify (`plan`) and settles it per request (`verified`)."""

    def __init__(
        self, source: DraftSource, kv: KVManager, stats: SchedulerStats, context_length: int
    ) -> None:
        self.source = source
        self.kv = kv
        self.stats = stats
        self.context_length = context_length
        stats.speculative = True

    def plan(self, batch: ScheduleBatch) -> VerifyInput | None:
        """The decode batch's verify step, or None: nothing drafted, or the drafts' KV does not fit
        in the free pages (drafts never evict the prefix cache)."""
        drafts = self.source.drafts(batch.reqs, self.context_length)
        forks: list[list[Matcher]] = []
        if any(req.grammar is not None for req in batch.reqs):
            cut = [draft_matchers(req, draft) for req, draft in zip(batch.reqs, drafts)]
            drafts, forks = [draft for draft, _ in cut], [f for _, f in cut]
        if not any(drafts) or not self.kv.fits_free(batch.reqs, [1 + len(d) for d in drafts]):
            return None
        return VerifyInput(batch.reqs, drafts, forks)

    def verified(self, req: Req, draft: list[int], taken: int) -> None:
        """After a verify step: the KV of the rows past the tokens taken freed (never cached), the
        logprobs of the rows not taken dropped, the draft source told."""
        self.kv.trim(req, req.kv_len - (1 + len(draft)) + taken)
        if req.return_logprob:
            lp = req.output_logprobs
            keep = len(req.output_ids) - req.resumed_len
            del lp.values[keep:], lp.token_ids[keep:], lp.top[keep:], lp.ids[keep:]
        self.source.verified(req, draft, taken)
        if draft:
            self.stats.on_verified(taken)

    def forget(self, req: Req) -> None:
        """A finished request: the KV of a verify step's rows freed if it was aborted while their ids
        were on the way, its draft state dropped."""
        if req.kv_len > req.seq_len:
            self.kv.trim(req, req.seq_len)
        self.source.forget(req.rid)


def new_speculator(
    args: ServerArgs,
    runner: ModelRunner,
    parallel: ParallelState,
    kv: KVManager,
    stats: SchedulerStats,
    context_length: int,
) -> Speculator | None:
    """`--speculative-algorithm`'s speculator; None without one."""
    if args.speculative_algorithm is None:
        return None
    if not runner.info.batch_invariant:
        raise ValueError(
            f"--speculative-algorithm cannot keep outputs unchanged with --quantization {args.quantization} "
            "on this CPU: its kernels give a row other bits in a batch of more rows (the file's blocks "
            "take every row count alike only on AVX-512 BF16 and VNNI without AMX)"
        )
    source: DraftSource
    if args.speculative_algorithm == "NGRAM":
        source = NgramDrafts(args.num_draft_tokens, args.speculative_ngram_max_trie_depth)
    else:
        assert args.speculative_algorithm == "STANDALONE"
        source = ModelDrafts(load_drafter(args, runner, parallel), args.num_draft_tokens)
    return Speculator(source, kv, stats, context_length)
