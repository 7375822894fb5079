"""The per-rank scheduler: receive (broadcast) -> schedule -> run -> process, forever.

Every rank runs this loop on identical inputs, so every rank picks the same batch and issues the
same collectives in the same order (ARCHITECTURE.md, "The one invariant").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

import consensus
from consensus import rank_consensus
from mem_cache.disk_tier import open_disk_tier
from mem_cache.radix_cache import BasePrefixCache, NoPrefixCache, RadixCache
from model_executor.constrained import JsonOptions, LazyGrammarBackend
from model_executor.distributed.parallel_state import ParallelState
from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.model_runner import ModelRunner
from model_executor.sampling_inputs import SamplingInputs
from scheduler.admission import Admission, RequestQueues
from scheduler.fault_injection import FaultInjector
from scheduler.grammar import advance, attach_matcher
from scheduler.kv_manager import KVManager
from scheduler.logprobs import LogprobPlan, plan_logprobs, record_logprobs, samples_a_token
from scheduler.lora_registry import LoraRegistry
from scheduler.output import mark_sent, token_output
from scheduler.receiver import RequestReceiver
from scheduler.req import Req
from scheduler.schedule_batch import Launched, ScheduleBatch
from scheduler.speculative import Speculator, new_speculator
from scheduler.stats import LoadSnapshot, SchedulerStats
from scheduler.stop import StopChecker
from scheduler.weight_registry import WEIGHT_MESSAGES, WeightRegistry
from srt.io_struct import (
    AbortReq,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    GetInternalStateReq,
    GetLoadReq,
    LoadLoraAdapterReq,
    ReleaseMemoryReq,
    TokenizedGenerateReq,
    UnloadLoraAdapterReq,
)
from srt.metrics import RankMetrics
from srt.server_args import ServerArgs

logger = logging.getLogger("srt.scheduler")

IDLE_WAIT_MS = 100


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        parallel: ParallelState,
        runner: ModelRunner,
        receiver: RequestReceiver,
        send_output: Callable[[Any], None] | None,
        eos_token_ids: set[int],
        tokenizer_loader: Callable[[], Any],
        metrics: RankMetrics | None = None,
    ) -> None:
        if server_args.is_embedding:
            # Every prompt is pooled whole, in one step (its chunk as long as the context may be), and
            # its own: no cached prefix stands in for its first tokens.
            longest = runner.info.context_length
            server_args = dataclasses.replace(
                server_args,
                disable_radix_cache=True,
                chunked_prefill_size=max(server_args.chunked_prefill_size, longest),
                max_prefill_tokens=max(server_args.max_prefill_tokens, longest),
            )
        self.args = server_args
        self.parallel = parallel
        self.runner = runner
        self.receiver = receiver
        self.send_output = send_output  # set on the output rank only
        self.faults = FaultInjector(parallel.world.ranks[parallel.world.rank_in_group])
        self._init_cache()
        self._init_state()
        self.admission = self._new_admission()
        self.weights = WeightRegistry.of(self)  # the weights' folder and version, the pause state
        self.stats = SchedulerStats(
            self._load,
            log_enabled=send_output is not None,
            decode_log_interval=server_args.decode_log_interval,
            metrics=metrics,
            expert_tokens=lambda: self.runner.state().get("moe_expert_tokens", []),
        )
        self._init_sampling(eos_token_ids, tokenizer_loader)

    def _init_cache(self) -> None:
        memory = self.runner.memory
        self.tree_cache: BasePrefixCache = (NoPrefixCache if self.args.disable_radix_cache else RadixCache)(
            memory.free_slots, page_size=memory.page_size, device=self.runner.device
        )
        original = self.runner.info.long_rope_original
        disk = open_disk_tier(self.args, self.parallel, memory.kv_pool)  # None unless --enable-hicache
        self.kv = KVManager(memory, self.tree_cache, None if original is None else int(original), disk)

    def _init_state(self) -> None:
        # LoRA adapters by name: --lora-paths' as the runner loaded them, then the runtime's changes
        self.lora = LoraRegistry.of(
            self.args.lora_adapters, self.parallel.world, self.runner.set_lora_adapter
        )
        self.queues = RequestQueues()
        self.forward_steps = 0
        self.outbox: list[Req] = []  # requests with something to stream this step

    def _new_admission(self) -> Admission:
        return Admission(self.args, self.queues, self.kv, self.faults, self._finish)

    def _init_sampling(self, eos_token_ids: set[int], tokenizer_loader: Callable[[], Any]) -> None:
        args = self.args
        self.stop_checker = StopChecker(eos_token_ids, tokenizer_loader)
        self.sync_token_ids = args.sync_token_ids_across_tp and self.parallel.tp_size > 1
        self.grammars = LazyGrammarBackend(
            args.grammar_backend,
            tokenizer_loader,
            self.runner.vocab_size,
            eos_token_ids,
            JsonOptions.of(args),
        )
        self.grammar_sync_on = False  # the last sampled batch held a constrained request (at tp > 1)
        self.context_length = self.runner.info.context_length
        self.speculator: Speculator | None = new_speculator(
            args, self.runner, self.parallel, self.kv, self.stats, self.context_length
        )
        # the front end times first tokens (metrics, deadlines): a request's first token goes out at once
        self.first_token_at_once = bool(
            args.enable_metrics or args.req_waiting_timeout or args.req_running_timeout
        )

    # The queues, by their usual names (tests and the watchdog read them).
    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def chunked_req(self) -> Req | None:
        return self.queues.chunked_req

    @chunked_req.setter
    def chunked_req(self, req: Req | None) -> None:
        self.queues.chunked_req = req

    def has_work(self) -> bool:
        return self.queues.has_work() and not self.weights.paused  # paused: idle, not stalled

    def get_next_batch(self) -> ScheduleBatch | None:
        return self.admission.get_next_batch(self.forward_steps + 1)

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        while True:
            self.step()

    def step(self) -> None:
        busy = self.has_work()
        self.stats.timer.begin()
        messages = self._receive(busy)
        self.stats.timer.received()
        self.process_messages(messages)
        if self.lora.unloading:
            for reply in self.lora.finish_unloads({r.lora_id for r in self.queues.live() + self.waiting}):
                self._reply(reply)
        for reply in self.weights.between_steps(self.queues, self.launches_in_flight()):
            self._reply(reply)
        batch = None if self.weights.holds_steps else self.get_next_batch()
        if batch is not None:
            self.run_batch(batch)
        else:
            self.stats.on_idle()
        self.flush_outputs()
        self.stats.publish()
        self.stats.timer.end(counted=busy and batch is not None)

    # ------------------------------------------------------------------ messages
    def _receive(self, busy: bool) -> list[Any]:
        return self.receiver.recv(0 if busy else IDLE_WAIT_MS)

    def process_messages(self, messages: list[Any]) -> None:
        for msg in messages:
            if isinstance(msg, TokenizedGenerateReq):
                self._add_request(msg)
            elif isinstance(msg, AbortReq):
                self._abort(msg.rid, msg.reason, msg.status_code)
            elif isinstance(msg, FlushCacheReq):
                self._reply(self.kv.flush_cache(msg, idle=not self.queues.has_work()))
            elif isinstance(msg, ReleaseMemoryReq):
                logger.warning("releasing KV memory: %s", msg.reason)
                self.kv.release_memory(evict=True)
            elif isinstance(msg, GetInternalStateReq):
                self._reply(ControlReply(msg.request_id, True, self.internal_state()))
            elif isinstance(msg, GetLoadReq):
                self._reply(ControlReply(msg.request_id, True, self.load_report()))
            elif isinstance(msg, (LoadLoraAdapterReq, UnloadLoraAdapterReq)):
                if (reply := self.lora.apply(msg)) is not None:
                    self._reply(reply)
            elif isinstance(msg, WEIGHT_MESSAGES):
                self.weights.receive(msg)
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")

    def _add_request(self, msg: TokenizedGenerateReq) -> None:
        lora_id = self.lora.id_of(msg.lora_path) if msg.lora_path is not None else 0
        req = Req.of(msg, lora_id or 0)
        req.weight_epoch = self.weights.epoch
        # the matcher synchronously: every rank has it ready now
        reason = attach_matcher(self.grammars, req) or self.admission.finish_at_arrival(
            req, msg.lora_path if lora_id is None else None
        )
        if reason is not None:
            self._finish(req, reason)
        else:
            self.waiting.append(req)

    @rank_consensus(args=("rid",))
    def _abort(self, rid: str, reason: str, status_code: int | None = None) -> None:
        req = next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.waiting.remove(req)
        elif (req := next((r for r in self.running if r.rid == rid), None)) is not None:
            self.running.remove(req)
        elif self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
        else:
            return
        logger.info("aborted %s: %s", rid, reason)
        self._finish(req, FinishReason("abort", status_code=status_code, message=reason))

    def launches_in_flight(self) -> bool:
        return False  # a pipeline's micro-batches are (scheduler/pipeline.py)

    def _reply(self, reply: ControlReply) -> None:
        if self.send_output is not None:
            self.send_output(reply)

    # ------------------------------------------------------------------ execution
    def run_batch(self, batch: ScheduleBatch) -> None:
        launched = self.launch(batch)
        assert launched.next_ids is not None, "a single-stage rank samples every batch it runs"
        self.complete(launched, launched.next_ids)

    @torch.inference_mode()
    def launch(self, batch: ScheduleBatch) -> Launched:
        """Runs this rank's part of the step and moves every state the step decides: KV slots and
        lengths, the chunked prompt, a finished prompt joining `running`. What waits is only the
        sampled tokens: `complete` appends them (at once on one stage; a pipeline completes a
        micro-batch when its ids come back from the last stage)."""
        consensus.agree_before_step(batch.identity)  # checker on: TP ranks agree
        self.stats.timer.forward_begin()
        if batch.forward_mode is ForwardMode.DECODE:
            if self.speculator is not None:  # the one way into speculation: a verify step's plan
                batch.verify = self.speculator.plan(batch)
            ok = self.kv.reserve_extend(batch.reqs, batch.new_lens)
            assert ok, "decode room was checked"
            self.stats.on_decode()
        else:
            self.stats.on_prefill(batch)
        forward_batch = batch.to_forward_batch(self.kv.last_out_cache_loc, self.runner.device)
        step = self.forward_steps + 1
        self.faults.before_forward(step)
        ids = self._run(batch, forward_batch, step)
        self.forward_steps = step
        sampled = [batch.samples(i) for i in range(len(batch.reqs))]  # before kv_len moves
        tokens = sum(samples_a_token(batch, i) for i in range(len(batch.reqs)))
        for req, n, done in zip(batch.reqs, batch.new_lens, sampled):
            req.kv_len += n  # a verify step's: until `complete` trims the rejected drafts
            if not done:
                self.chunked_req = req  # a mid-prompt chunk: its next chunk may run at once
                continue
            req.awaiting_token = True
            if batch.forward_mode is ForwardMode.EXTEND and req.sampling_params.max_new_tokens > 0:
                self.running.append(req)
        self.stats.timer.forward_end()
        self.stats.after_step(tokens)
        return Launched(batch, sampled, ids)

    def _run(self, batch: ScheduleBatch, forward_batch: ForwardBatch, step: int) -> list[int] | None:
        """The step's forward and sampled ids (None on an earlier pipeline stage), its logprobs
        recorded: a row per request, in a verify step per request and draft (every row's logprobs
        are recorded; `complete` keeps those of the tokens taken). With --is-embedding each request
        keeps its prompt's embedding instead (every rank computes the same); its request asked for
        no token, so `complete` finishes it."""
        rows = batch.logprob_rows()
        plan = plan_logprobs(rows, compute=self.send_output is not None)  # None unless one asked
        inputs = self._sampling_inputs(batch, step, plan)
        out = self.runner.step(forward_batch, inputs)
        if out is None:
            return None
        if inputs.sync_across_tp:
            self.stats.on_token_sync()
        if plan is not None and out.logprobs is not None:
            record_logprobs(rows, plan, out.logprobs)
        for req, embedding in zip(batch.reqs, out.embeddings or []):
            req.embedding = embedding
        return out.next_ids

    def _sampling_inputs(self, batch: ScheduleBatch, step: int, plan: LogprobPlan | None) -> SamplingInputs:
        """How the runner turns this step's logits into ids: each sampled row's settings (a verify
        step's rows: scheduler/speculative.py) and, when a request of the batch is constrained, its
        row's matcher. The TP sync is a scheduling decision, made from the batch, the same on every
        rank: always with --sync-token-ids-across-tp, with a grammar in the batch (SGLang's rule:
        each rank's matcher follows its ids), and in a verify step (the accept counts follow the ids)."""
        reqs, outputs, grammars = batch.sampling_rows()
        eos = self.stop_checker.eos_token_ids
        constrained = any(g is not None for g in grammars)
        vocab = self.runner.vocab_size
        verify = batch.verify is not None and self.parallel.tp_size > 1
        return SamplingInputs(
            temperatures=[r.sampling_params.temperature for r in reqs],
            top_ps=[r.sampling_params.top_p for r in reqs],
            top_ks=[r.sampling_params.top_k for r in reqs],
            min_ps=[r.sampling_params.min_p for r in reqs],
            seeds=[r.seed for r in reqs],
            output_positions=[len(out) for out in outputs],
            penalties=[r.sampling_params.penalties for r in reqs],
            output_ids=outputs,
            prompt_ids=[r.origin_input_ids for r in reqs],
            logit_biases=[r.sampling_params.logit_bias for r in reqs],
            banned_ids=[r.sampling_params.banned_ids(len(out), eos) for r, out in zip(reqs, outputs)],
            grammars=grammars if constrained else [],
            grammar_backend=self.grammars if constrained else None,
            logprobs=None if plan is None else plan.rows,
            sync_across_tp=self.sync_token_ids or self._grammar_sync(constrained) or verify,
            corrupt_ids=(lambda ids: self.faults.corrupt_tokens(step, ids, vocab))
            if self.faults.active
            else None,
        )

    def _grammar_sync(self, constrained: bool) -> bool:
        """Whether this step's ids are MIN-reduced for its grammars (decided from the batch, the
        same on every rank); the output rank logs each change."""
        on = constrained and self.parallel.tp_size > 1
        if on != self.grammar_sync_on and not self.sync_token_ids and self.send_output is not None:
            logger.info(
                "token-id sync across TP %s",
                "on: the batch holds a constrained request"
                if on
                else "off: no constrained request in the batch",
            )
        self.grammar_sync_on = on
        return on

    def complete(self, launched: Launched, next_ids: list[int]) -> None:
        """Appends a launched batch's sampled tokens, checks stops, finishes requests. In a verify
        step a request takes its samples while they equal its drafts, each token checked in turn."""
        batch, verify = launched.batch, launched.batch.verify
        taking = [[int(t)] for t in next_ids] if verify is None else verify.accepted(next_ids)
        for i, req in enumerate(batch.reqs):
            if not launched.sampled[i] or req.finished:
                continue  # a mid-prompt chunk, or aborted while its tokens were on the way
            req.awaiting_token = False
            if not req.output_ids:
                self.stats.on_prompt_done(req)
            if req.sampling_params.max_new_tokens == 0:  # a prompt scored for its logprobs only
                self._finish(req, FinishReason("length"))
                continue
            taken, reason = 0, None
            for token in taking[i]:
                req.output_ids.append(token)
                taken += 1
                reason = advance(req, token, skip=self.faults.skip_grammar_accept(self.forward_steps, req))
                reason = reason or self.stop_checker.check(req)
                if reason is not None:
                    break
            if verify is not None:
                assert self.speculator is not None
                self.speculator.verified(req, verify.drafts[i], taken)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            elif req.stream and len(req.output_ids) - req.sent_len >= self.args.stream_interval:
                self.outbox.append(req)
            elif req.sent_len == 0 and (req.stream or self.first_token_at_once):
                self.outbox.append(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        if self.speculator is not None:
            self.speculator.forget(req)
        if req.return_routed_experts and self.send_output is not None:
            req.routed_experts = self.kv.routed_experts(req)
        self.kv.release(req, insert=True)
        self.outbox.append(req)

    def flush_outputs(self) -> None:
        reqs, self.outbox = self.outbox, []
        if self.send_output is None:
            for req in reqs:
                mark_sent(req)
        elif reqs:
            self.send_output(token_output(reqs))

    # ------------------------------------------------------------------ introspection
    def _load(self) -> LoadSnapshot:
        return LoadSnapshot(
            running=len(self.running) + (self.chunked_req is not None),
            waiting=len(self.waiting),
            used_tokens=self.kv.held_tokens(),
            max_total_tokens=self.kv.max_total_tokens,
            **self.kv.page_counts(),
            disk=self.kv.disk_counts(),
        )

    def load_report(self) -> dict[str, int]:
        """SGLang's load fields: requests running and waiting, and the KV tokens they hold or will
        need first (held by running requests, plus the prompts waiting)."""
        load = self._load()
        return {
            "num_reqs": load.running + load.waiting,
            "num_waiting_reqs": load.waiting,
            "num_tokens": load.used_tokens + sum(r.seq_len for r in self.waiting),
        }

    def internal_state(self) -> dict[str, Any]:
        return {
            "forward_steps": self.forward_steps,
            "running": [r.rid for r in self.running],
            "waiting": [r.rid for r in self.waiting],
            "chunked": self.chunked_req.rid if self.chunked_req else None,
            "new_token_ratio": self.admission.new_token_ratio,
            "step_timing": self.stats.timer.as_dict(),
            "kv_cache_bytes": self.kv.kv_pool.total_bytes,
            **self.runner.state(),
            **self.kv.stats(self.queues.live()),
            **({"lora_adapters": self.lora.snapshot()} if self.args.lora_enabled else {}),
        }
