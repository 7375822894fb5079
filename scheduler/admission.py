from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from consensus import rank_consensus
from model_executor.forward_batch import ForwardMode
from scheduler.fault_injection import FaultInjector
from scheduler.grammar import rebuild_matcher
from scheduler.kv_manager import KVManager
from scheduler.policy import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    PrefillBudget,
    decode_reserve,
    order_waiting,
)
from scheduler.req import Req
from scheduler.schedule_batch import ScheduleBatch
from srt.io_struct import FinishReason
from srt.server_args import ServerArgs

logger = logging.getLogger("srt.scheduler")


@dataclass
class RequestQueues:
    """The requests a rank holds, the same lists on every rank: waiting (arrival order; a retracted
    request goes first), running (decoding), and the one prompt part-way through chunked prefill."""

    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def live(self) -> list[Req]:
        """The requests that hold KV: running, and the chunked prompt."""
        return self.running + ([self.chunked_req] if self.chunked_req else [])


class Admission:
    """The scheduler's batch choice over its queues and KV memory. Moves requests between the queues
    (admitted, retracted) and finishes the ones that can never fit through `finish`. A pipeline
    rank overrides the prefill cap and the decode candidates (scheduler/pipeline.py)."""

    def __init__(
        self,
        args: ServerArgs,
        queues: RequestQueues,
        kv: KVManager,
        faults: FaultInjector,
        finish: Callable[[Req, FinishReason], None],
    ) -> None:
        self.args = args
        self.queues = queues
        self.kv = kv
        self.faults = faults
        self.finish = finish
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def finish_at_arrival(self, req: Req, unknown_adapter: str | None) -> FinishReason | None:
        """Why a request just received ends at once (alike on every rank: the queues are), or None
        to queue it: an adapter the ranks no longer have, nothing to generate, a full waiting
        queue, a prompt the KV cache cannot hold."""
        if unknown_adapter is not None:
            # the front end checks names first: one unloaded (or being unloaded) since it checked
            message = f"lora_path: no LoRA adapter named {unknown_adapter!r} on the ranks"
            return FinishReason("abort", status_code=400, message=message)
        if req.remaining_new_tokens == 0 and not req.prompt_logprob_positions and not self.args.is_embedding:
            return FinishReason("length")
        limit = self.args.max_queued_requests
        if limit is not None and len(self.queues.waiting) >= limit:
            waiting = len(self.queues.waiting)
            message = f"{waiting} requests are waiting already (--max-queued-requests {limit}); retry later"
            return FinishReason("abort", status_code=503, message=message)
        if req.seq_len + 1 > self.kv.max_total_tokens:
            return FinishReason(
                "abort",
                message=(
                    f"prompt of {req.seq_len} tokens cannot fit in the KV cache "
                    f"({self.kv.max_total_tokens} tokens); raise {self.kv.memory.budget.flag}"
                ),
            )
        return None

    @rank_consensus(result=lambda b: None if b is None else b.identity)
    def get_next_batch(self, step: int) -> ScheduleBatch | None:
        """The batch of forward step `step`, or None when nothing can run."""
        batch = self._get_prefill_batch(step)
        if batch is not None:
            return batch
        reqs = self._make_room_for_decode(self._decode_candidates())
        if not reqs:
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs))

    def _prefill_token_cap(self) -> int:
        return self.args.max_prefill_tokens

    def _decode_candidates(self) -> list[Req]:
        """Running requests whose last token is known (a pipeline has others on the way)."""
        return [r for r in self.queues.running if not r.awaiting_token]

    def _get_prefill_batch(self, step: int) -> ScheduleBatch | None:
        if not self.queues.waiting and self.queues.chunked_req is None:
            return None
        budget = PrefillBudget(
            max_prefill_tokens=self._prefill_token_cap(),
            chunked_prefill_size=self.args.chunked_prefill_size,
            free_tokens=self.kv.available_tokens(),
            reserved_tokens=sum(decode_reserve(r, self.new_token_ratio) for r in self.queues.running),
            page_size=self.kv.page_size,
        )
        reqs: list[Req] = []
        lens: list[int] = []
        used = 0
        if self.queues.chunked_req is not None:
            req, self.queues.chunked_req = self.queues.chunked_req, None
            n = budget.chunk_for(req.extend_len, used)
            reqs.append(req)
            lens.append(n)
            used += n
        priority_first = (
            (-1 if self.args.schedule_low_priority_values_first else 1)
            if self.args.enable_priority_scheduling
            else 0
        )
        ordered = order_waiting(
            self.queues.waiting, self.args.schedule_policy, self.kv.peek_prefix_len, priority_first
        )
        # the LoRA adapters running or admitted: at most --max-loras-per-batch in one batch (SGLang's rule)
        adapters = {r.lora_id for r in self.queues.running + reqs} - {0}
        for req in ordered:
            if (
                len(self.queues.running) + len(reqs) >= self.args.max_running_requests
                or not self.kv.free_rows()
                or len(adapters | {req.lora_id} - {0}) > self.args.max_loras_per_batch
            ):
                break
            prefix_len, match = self.kv.match(req)
            n = budget.chunk_for(req.seq_len - prefix_len, used)
            partial = n < req.seq_len - prefix_len
            if n == 0 or (
                partial and (self.args.is_embedding or any(r.extend_len > m for r, m in zip(reqs, lens)))
            ):
                break  # out of prefill budget, a second partial prompt (one chunked request at a time), or
                # a partial one where each prompt is pooled whole (--is-embedding)
            # The decode reserve is a forecast: with nothing else in flight, the prompt alone decides.
            reserve = decode_reserve(req, self.new_token_ratio) if self.queues.running or reqs else 0
            if not budget.fits(n, reserve, used):
                break  # first come, first served: no overtaking when memory is short
            self.kv.admit(req, match)  # nothing changed the tree since the lookup
            budget.free_tokens = self.kv.available_tokens()  # its prefix is locked now, not evictable
            n = min(n, req.extend_len)
            self.queues.waiting.remove(req)
            reqs.append(req)
            lens.append(n)
            used += n
            adapters |= {req.lora_id} - {0}
        if self.faults.drop_one_admission(step) and reqs and reqs[-1] in ordered:
            req = reqs.pop()
            lens.pop()
            self.kv.release(req, insert=False)
            self.queues.waiting.insert(0, req)
        while reqs and not self.kv.reserve_extend(reqs, lens):
            # The token budget is an estimate (partly filled pages): drop the newest until it fits.
            req = reqs.pop()
            lens.pop()
            if req.kv_len > req.cached_len:  # a chunked prompt keeps what it already computed
                self.queues.chunked_req = req
            else:
                self.kv.release(req, insert=False)
                self.queues.waiting.insert(0, req)
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens) if reqs else None

    def _make_room_for_decode(self, reqs: list[Req]) -> list[Req]:
        """Evicts cache, then retracts the newest of `reqs` until one decode step of the rest fits."""
        while reqs and not self.kv.fits_decode(reqs):
            req = reqs.pop()
            self.queues.running.remove(req)
            if self.queues.running:  # others hold KV (some may be in flight): this one waits and resumes
                self._retract(req)
            else:
                self.finish(
                    req,
                    FinishReason(
                        "abort",
                        message=(
                            f"request needs more KV cache than the server has ({self.kv.max_total_tokens} tokens); "
                            "raise --max-total-tokens or lower max_new_tokens"
                        ),
                    ),
                )
        return reqs

    def retract(self, req: Req) -> None:
        """Puts `req` (taken off `running` by the caller) first in the waiting queue with its tokens,
        its KV released into the prefix cache: it resumes from what it holds (a pause's retract)."""
        self._retract(req)

    @rank_consensus(args={"req": lambda r: r.rid})
    def _retract(self, req: Req) -> None:
        self.kv.release(req, insert=True)
        req.retractions += 1
        rebuild_matcher(req)  # from the delivered tokens, as a replay would
        self.queues.waiting.insert(0, req)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.info("retracted %s (%d output tokens kept) to free KV cache", req.rid, len(req.output_ids))
