"""One scheduled step: which requests run, in which phase, and how many tokens each feeds."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from scheduler.req import Req


class Phase(enum.Enum):
    PREFILL = "prefill"  # new prompts (or the next chunk of one), possibly after a cached prefix
    DECODE = "decode"  # one token for every running request


@dataclass
class ScheduleBatch:
    phase: Phase
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request feeds this step

    def __post_init__(self) -> None:
        assert self.reqs and len(self.reqs) == len(self.extend_lens)
        for req, n in zip(self.reqs, self.extend_lens):
            assert req.req_pool_idx is not None and 1 <= n <= req.extend_len, (req.rid, n, req.extend_len)

    @property
    def rids(self) -> list[str]:
        return [r.rid for r in self.reqs]

    @property
    def identity(self) -> tuple[str, list[str], list[int]]:
        """What ranks compare to agree they run the same batch (consensus events and gates)."""
        return self.phase.value, self.rids, self.extend_lens

    def samples(self, i: int) -> bool:
        """Whether request i completes its prompt this step (a mid-prompt chunk samples nothing)."""
        return self.reqs[i].kv_len + self.extend_lens[i] == self.reqs[i].seq_len

    def to_forward_batch(
        self, out_cache_loc: torch.Tensor, device: torch.device, drafts: list[list[int]] | None = None
    ) -> ForwardBatch:
        if drafts is not None:
            return self._verify_batch(out_cache_loc, device, drafts)
        input_ids: list[int] = []
        for req, n in zip(self.reqs, self.extend_lens):
            input_ids += (
                req.fill_ids[req.kv_len : req.kv_len + n]
                if self.phase is Phase.PREFILL
                else [req.output_ids[-1]]
            )
        mode = ForwardMode.EXTEND if self.phase is Phase.PREFILL else ForwardMode.DECODE
        rows = [r.req_pool_idx for r in self.reqs]
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [r.kv_len + n for r, n in zip(self.reqs, self.extend_lens)]
        prompts = [len(r.origin_input_ids) for r in self.reqs]
        return make_forward_batch(
            mode,
            input_ids,
            rows,  # type: ignore[arg-type]
            prefix_lens,
            seq_lens,
            out_cache_loc,
            device,
            prompts,
        )

    def verify_rows(self, drafts: list[list[int]]) -> ScheduleBatch:
        """A verify step's rows as a batch of their own, request i repeated once per row (its
        logprob rows are planned and recorded over it)."""
        reqs = [req for req, draft in zip(self.reqs, drafts) for _ in range(1 + len(draft))]
        return ScheduleBatch(self.phase, reqs, [1] * len(reqs))

    def _verify_batch(
        self, out_cache_loc: torch.Tensor, device: torch.device, drafts: list[list[int]]
    ) -> ForwardBatch:
        """A decode step's rows with each request's drafts after its last token, a decode row each
        (scheduler/speculative.py): row j of a request at position kv_len + j."""
        assert self.phase is Phase.DECODE and len(drafts) == len(self.reqs)
        input_ids: list[int] = []
        rows: list[int] = []
        prefix_lens: list[int] = []
        prompts: list[int] = []
        for req, draft in zip(self.reqs, drafts):
            input_ids += [req.output_ids[-1], *draft]
            rows += [req.req_pool_idx] * (1 + len(draft))  # type: ignore[list-item]
            prefix_lens += range(req.kv_len, req.kv_len + 1 + len(draft))
            prompts += [len(req.origin_input_ids)] * (1 + len(draft))
        seq_lens = [p + 1 for p in prefix_lens]
        return make_forward_batch(
            ForwardMode.DECODE, input_ids, rows, prefix_lens, seq_lens, out_cache_loc, device, prompts
        )


@dataclass
class Launched:
    """A batch whose forward ran on this rank and whose sampled tokens are not appended yet."""

    batch: ScheduleBatch
    sampled: list[bool]  # request i completed its prompt (a token is sampled from its logits)
    next_ids: list[int] | None  # on the last pipeline stage; the others receive them later
    drafts: list[list[int]] | None = None  # a verify step's drafts per request (scheduler/speculative.py)

    @property
    def num_rows(self) -> int:
        """Sampled rows: one per request, and one per draft."""
        return len(self.batch.reqs) + sum(map(len, self.drafts or []))
