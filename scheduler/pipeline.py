"""The step loop of a pipeline-parallel rank: several micro-batches in flight, every stage's
scheduler still deciding the same things in the same order.

Iteration t on every rank of every stage:

    1. complete the micro-batch launched at t - K (K = --pp-micro-batches, default --pp-size):
       the last stage sampled its ids then; the other stages receive them from it now
    2. messages of iteration t: stage 0 drains the front end's socket (rank 0) and broadcasts over
       its TP group; every stage passes them on to the next stage with the hidden states
    3. schedule (identical everywhere: the same state, the same messages); with the consensus
       checker on, each stage passes a digest of what it scheduled to the next, which stops with
       a message naming both when they differ (before any hidden state is sent or received)
    4. launch: receive the previous stage's hidden states, run this stage's layers, send them on;
       the last stage runs the LM head, samples, and sends the ids to every other stage

    stage 0:  [mb0][mb1][mb0'][mb1'] ...      a micro-batch's requests are scheduled again only
    stage 1:       [mb0][mb1][mb0'] ...       after its sampled ids came back (step 1)

A request is in at most one micro-batch until its token is appended (`Req.awaiting_token`), and
decode micro-batches take at most their share of the running requests, so K of them keep every
stage busy. With K = 1 exactly one batch is in flight (the stages take turns): the baseline that
`scripts/bench_pipeline.py` compares against.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import consensus
from consensus.canonical import canonical, event_digest
from model_executor.forward_batch import ForwardMode
from scheduler.admission import Admission
from scheduler.req import Req
from scheduler.schedule_batch import Launched, ScheduleBatch
from scheduler.scheduler import Scheduler

MIN_PREFILL_SHARE = 256  # prompt tokens: below this a prefill is not split over micro-batches


class PipelineAdmission(Admission):
    """Admission with several micro-batches in flight: prefills and decode batches shared out so
    the micro-batches stay about equal."""

    def __init__(self, *args: Any, in_flight: deque[Launched | None], micro_batches: int) -> None:
        super().__init__(*args)
        self.in_flight = in_flight
        self.micro_batches = micro_batches

    def _prefill_token_cap(self) -> int:
        """A burst of prompts is shared out over the micro-batches: the first takes 1/K of the
        waiting prompt tokens, the next ones as much as the largest prefill in flight, so the
        stages get about equal work (a long prompt goes through them as chunks, one behind the
        other) without the tail halving into ever smaller batches."""
        chunked = self.queues.chunked_req
        pending = sum(r.extend_len for r in self.queues.waiting) + (chunked.extend_len if chunked else 0)
        in_flight = max(
            (
                sum(b.batch.extend_lens)
                for b in self.in_flight
                if b is not None and b.batch.forward_mode is ForwardMode.EXTEND
            ),
            default=0,
        )
        share = max(-(-pending // self.micro_batches), in_flight, MIN_PREFILL_SHARE)
        return min(self.args.max_prefill_tokens, share)

    def _decode_candidates(self) -> list[Req]:
        """Each decode micro-batch takes at most its share of the running requests."""
        return super()._decode_candidates()[: -(-len(self.queues.running) // self.micro_batches)]


class PipelineScheduler(Scheduler):
    def __init__(self, *args: Any, micro_batches: int, **kwargs: Any) -> None:
        self.micro_batches = micro_batches
        self.in_flight: deque[Launched | None] = deque()  # the last K iterations' batches (None: idle)
        super().__init__(*args, **kwargs)
        self.link = self.runner.stage_link  # None: one stage (tests run the loop in one process)

    def _new_admission(self) -> Admission:
        return PipelineAdmission(
            self.args,
            self.queues,
            self.kv,
            self.faults,
            self._finish,
            in_flight=self.in_flight,
            micro_batches=self.micro_batches,
        )

    def has_work(self) -> bool:
        return super().has_work() or any(launched is not None for launched in self.in_flight)

    def launches_in_flight(self) -> bool:
        return any(launched is not None for launched in self.in_flight)

    def step(self) -> None:
        if len(self.in_flight) == self.micro_batches:
            launched = self.in_flight.popleft()
            if launched is not None:
                ids = launched.next_ids
                if ids is None:  # not the last stage: the ids come from it, in launch order
                    ids = self.runner.receive_ids(launched.batch.num_rows)
                self.complete(launched, ids)
        launched_before = len(self.in_flight)
        super().step()  # messages, schedule, run_batch (below): the same step as on one stage
        if len(self.in_flight) == launched_before:
            self.in_flight.append(None)  # an idle iteration still takes its slot

    def get_next_batch(self) -> ScheduleBatch | None:
        batch = super().get_next_batch()
        if self.link is not None and consensus.get_checker() is not None:
            self._agree_with_previous_stage(batch)
        return batch

    def _agree_with_previous_stage(self, batch: ScheduleBatch | None) -> None:
        """The stage gate (checker on): stages that schedule differently would exchange hidden
        states of different shapes, which gloo may answer with SIGABRT and no word of why. Every
        iteration, batch or not, each stage receives the previous stage's summary of what it
        scheduled, compares, and passes its own on: one small object per stage boundary."""
        assert self.link is not None
        mine = (
            None
            if batch is None
            else (
                batch.forward_mode.value,
                len(batch.reqs),
                sum(batch.extend_lens),
                event_digest("step", canonical(batch.identity)),
            )
        )
        if not self.link.pp.is_first:
            theirs = self.link.recv_object(self.link.prev)
            if theirs != mine:
                stage = self.link.pp.rank_in_group
                raise RuntimeError(
                    f"pipeline stages scheduled different batches at forward step {self.forward_steps + 1}: "
                    f"stage {stage - 1} {describe_batch(theirs)}, stage {stage} {describe_batch(mine)}; "
                    f"the rank consensus gate stopped the step (the ranks' states diverged)"
                )
        if not self.link.pp.is_last:
            self.link.send_object(mine, self.link.next)

    def run_batch(self, batch: ScheduleBatch) -> None:
        """Launch only: its tokens are appended K iterations later (step)."""
        self.in_flight.append(self.launch(batch))

    def _receive(self, busy: bool) -> list[Any]:
        """This iteration's messages: from the front end on stage 0, from the stage before on the
        others; passed on to the next stage."""
        if self.link is None or self.link.pp.is_first:
            messages = super()._receive(busy)
        else:
            received = self.link.recv_object(self.link.prev)
            assert isinstance(received, list)
            messages = received
        if self.link is not None and not self.link.pp.is_last:
            self.link.send_object(messages, self.link.next)
        return messages


def describe_batch(summary: object) -> str:
    """A stage gate summary, (forward mode, requests, tokens, digest) or None, in words."""
    if not isinstance(summary, tuple):
        return "no batch"
    mode, reqs, tokens, digest = summary
    return f"{mode} of {reqs} requests / {tokens} tokens (digest {int(digest) & 0xFFFFFFFF:08x})"
