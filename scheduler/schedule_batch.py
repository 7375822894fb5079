"""One scheduled step: which requests run, in which forward mode, and how many tokens each feeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from scheduler.req import Req

if TYPE_CHECKING:
    from model_executor.constrained import Matcher
    from scheduler.speculative import VerifyInput


@dataclass
class ScheduleBatch:
    # EXTEND: new prompts (or the next chunk of one) after any cached prefix; DECODE: a token each
    forward_mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # tokens each request feeds this step
    # a decode step's drafts to verify, planned at launch (scheduler/speculative.py); None: a plain step
    verify: VerifyInput | None = None

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
        return self.forward_mode.value, self.rids, self.extend_lens

    @property
    def new_lens(self) -> list[int]:
        """The KV slots each request fills this step: its extend length, or in a verify step a
        row for its last token and each draft."""
        return self.extend_lens if self.verify is None else self.verify.row_lens

    @property
    def num_rows(self) -> int:
        """The ids the step samples: one per request, and in a verify step one per draft."""
        return len(self.reqs) if self.verify is None else self.verify.num_rows

    def samples(self, i: int) -> bool:
        """Whether request i completes its prompt this step (a mid-prompt chunk samples nothing)."""
        return self.reqs[i].kv_len + self.extend_lens[i] == self.reqs[i].seq_len

    def sampling_rows(self) -> tuple[list[Req], list[list[int]], list[Matcher | None]]:
        """Each sampled row's request, the output ids it samples after, and its matcher."""
        if self.verify is not None:
            return self.verify.sampling_rows()
        return self.reqs, [r.output_ids for r in self.reqs], [r.grammar for r in self.reqs]

    def logprob_rows(self) -> ScheduleBatch:
        """The batch whose rows the step's logprobs are planned and recorded over."""
        return self if self.verify is None else self.verify.rows()

    def to_forward_batch(self, out_cache_loc: torch.Tensor, device: torch.device) -> ForwardBatch:
        if self.verify is not None:
            return self.verify.forward_batch(out_cache_loc, device)
        input_ids: list[int] = []
        for req, n in zip(self.reqs, self.extend_lens):
            input_ids += (
                req.fill_ids[req.kv_len : req.kv_len + n]
                if self.forward_mode is ForwardMode.EXTEND
                else [req.output_ids[-1]]
            )
        rows = [r.req_pool_idx for r in self.reqs]
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [r.kv_len + n for r, n in zip(self.reqs, self.extend_lens)]
        prompts = [len(r.origin_input_ids) for r in self.reqs]
        return make_forward_batch(
            self.forward_mode,
            input_ids,
            rows,  # type: ignore[arg-type]
            prefix_lens,
            seq_lens,
            out_cache_loc,
            device,
            prompts,
            [r.lora_id for r in self.reqs],
        )


@dataclass
class Launched:
    """A batch whose forward ran on this rank and whose sampled tokens are not appended yet."""

    batch: ScheduleBatch
    sampled: list[bool]  # request i completed its prompt (a token is sampled from its logits)
    next_ids: list[int] | None  # on the last pipeline stage; the others receive them later
