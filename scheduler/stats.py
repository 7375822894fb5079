"""What a rank reports about its work: the periodic stats log (output rank) and its Prometheus
series (every rank, with --enable-metrics; see srt/metrics.py).

    Prefill batch. #new-seq: 2, #new-token: 96, #cached-token: 32, token usage: 0.01, #running-req: 3, #queue-req: 0
    Decode batch. #running-req: 5, #token: 620, token usage: 0.04, gen throughput (token/s): 85.31, #queue-req: 0

as SGLang prints them: a prefill line per prefill step, a decode line every
--decode-log-interval decode steps. Wall-clock time is read here for reporting only; nothing
scheduled depends on it. The log format names the process (scheduler_TP0) in every line.

`StepTimer` splits each busy step into receive + broadcast, scheduling, and forward + sample
(scripts/bench_control_plane.py reads it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.req import Req
from scheduler.schedule_batch import ScheduleBatch
from srt.metrics import RankMetrics

logger = logging.getLogger("srt.scheduler")


@dataclass
class LoadSnapshot:
    running: int  # requests decoding (and a prompt part-way through chunked prefill)
    waiting: int
    used_tokens: int  # KV held by requests (neither free nor evictable cache)
    max_total_tokens: int
    free_pages: int = 0  # KV pages: free, held by the prefix cache, allocated (cached or requests')
    cached_pages: int = 0
    used_pages: int = 0
    disk: dict[str, float] = field(default_factory=dict)  # the disk tier's counters (KVManager.disk_counts)

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.max_total_tokens if self.max_total_tokens else 0.0


@dataclass
class StepTimer:
    """Where this rank's busy steps spend their time, in seconds summed since start.

        |-- broadcast --|------------------- schedule + forward -------------------|
        begin     received   process_messages, get_next_batch, run_batch, flush...  end
                                               |-- forward --|  (run_batch up to the result processing)

    broadcast: `RequestReceiver.recv` (rank 0 drains its socket; `broadcast_pyobj` on every rank,
    which includes waiting for the slowest rank to get there); forward: the forward pass and
    sampling; schedule: the rest (messages, batch selection, result processing, outputs, gauges).
    Only steps that ran a batch and began busy count: a step that began idle waited on rank 0's
    socket on purpose (up to IDLE_WAIT_MS), and every rank's broadcast waits through that.
    A handful of perf_counter calls per step; with --enable-metrics the totals also go to
    `srt:step_{broadcast,schedule,forward}_seconds_total{rank}`.
    """

    metrics: RankMetrics | None = None
    steps: int = 0
    broadcast_s: float = 0.0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    _begin: float = 0.0  # marks of the step under way (perf_counter)
    _received: float = 0.0
    _forward_begin: float = 0.0
    _step_forward_s: float = 0.0

    def begin(self) -> None:
        self._begin = time.perf_counter()
        self._step_forward_s = 0.0

    def received(self) -> None:
        self._received = time.perf_counter()

    def forward_begin(self) -> None:
        self._forward_begin = time.perf_counter()

    def forward_end(self) -> None:
        self._step_forward_s += time.perf_counter() - self._forward_begin

    def end(self, counted: bool) -> None:
        """The step is over; `counted`: it began busy and ran a batch."""
        if not counted:
            return
        broadcast = self._received - self._begin
        forward = self._step_forward_s
        schedule = time.perf_counter() - self._received - forward
        self.steps += 1
        self.broadcast_s += broadcast
        self.schedule_s += schedule
        self.forward_s += forward
        if self.metrics is not None:
            self.metrics.step_time(broadcast, schedule, forward)

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "broadcast_s": self.broadcast_s,
            "schedule_s": self.schedule_s,
            "forward_s": self.forward_s,
        }


@dataclass
class SchedulerStats:
    load: Callable[[], LoadSnapshot]  # read only when a line is logged or a gauge refreshed
    log_enabled: bool  # the output rank logs; the others only count
    decode_log_interval: int
    metrics: RankMetrics | None = None
    expert_tokens: Callable[[], list[int]] | None = None  # a MoE model's tokens per expert, since start
    decode_steps: int = 0
    generated_since_log: int = 0  # output tokens since the last decode line (or since idle)
    last_log_time: float = field(default_factory=time.perf_counter)
    forward_steps: int = 0  # counted with metrics on
    prompt_tokens: int = 0  # of requests whose prompt is done, since start
    cache_hit_tokens: int = 0  # of those, served from the prefix cache
    speculative: bool = False  # verify steps: the decode line and /metrics show the accept length
    verified_since_log: int = 0  # request rows of verify steps since the last decode line
    taken_since_log: int = 0  # tokens they took (accepted drafts + 1 each)
    verified_total: int = 0  # the same since start (/metrics)
    taken_total: int = 0
    timer: StepTimer = field(init=False)

    def __post_init__(self) -> None:
        self.timer = StepTimer(self.metrics)

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def on_prefill(self, batch: ScheduleBatch) -> None:
        """Before a prefill step runs (its requests still hold their pre-step kv_len)."""
        if not self.log_enabled:
            return
        cached = sum(r.cached_len for r in batch.reqs if r.kv_len == r.cached_len)  # first chunks only
        load = self.load()
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            len(batch.reqs),
            sum(batch.extend_lens),
            cached,
            load.token_usage,
            load.running,
            load.waiting,
        )

    def on_prompt_done(self, req: Req) -> None:
        """A request sampled its first token: its prompt counts towards the cache hit rate."""
        self.prompt_tokens += len(req.origin_input_ids)
        self.cache_hit_tokens += req.cached_tokens

    def on_decode(self) -> None:
        """Before a decode step runs: every --decode-log-interval-th one logs a line."""
        self.decode_steps += 1
        if not self.log_enabled or self.decode_steps % self.decode_log_interval:
            return
        now = time.perf_counter()
        throughput = self.generated_since_log / max(now - self.last_log_time, 1e-9)
        self.generated_since_log, self.last_log_time = 0, now
        load = self.load()
        verified = self.verified_since_log
        accept = self.taken_since_log / verified if verified else 1.0
        self.verified_since_log = self.taken_since_log = 0
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): %.2f, "
            "#queue-req: %d",
            load.running,
            load.used_tokens,
            load.token_usage,
            f"accept len: {accept:.2f}, " if self.speculative else "",
            throughput,
            load.waiting,
        )
        if self.metrics is not None and self.metrics.is_output_rank:
            self.metrics.set(gen_throughput=throughput)
            if self.verified_total:
                self.metrics.set(spec_accept_length=self.taken_total / self.verified_total)

    def on_verified(self, taken: int) -> None:
        """A request of a verify step took `taken` tokens (its accepted drafts and one more)."""
        self.verified_since_log += 1
        self.taken_since_log += taken
        self.verified_total += 1
        self.taken_total += taken
        self.generated_since_log += taken - 1  # after_step counted one

    def after_step(self, sampled: int) -> None:
        """After a forward step that produced `sampled` output tokens. Every --decode-log-interval
        steps a MoE model's tokens per expert go to /metrics."""
        if self.metrics is not None:
            self.metrics.step()
            self.forward_steps += 1
            if self.expert_tokens is not None and self.forward_steps % self.decode_log_interval == 0:
                tokens = self.expert_tokens()
                if tokens:
                    self.metrics.experts(tokens)
        self.generated_since_log += sampled

    def on_token_sync(self) -> None:
        if self.metrics is not None:
            self.metrics.token_sync_steps.inc()

    def on_idle(self) -> None:
        """No batch ran: throughput is measured from the next busy step, not across the idle time."""
        if self.log_enabled:
            self.generated_since_log, self.last_log_time = 0, time.perf_counter()

    def publish(self) -> None:
        """Refresh the output rank's gauges (once per loop iteration, with --enable-metrics)."""
        if self.metrics is None or not self.metrics.is_output_rank:
            return
        load = self.load()
        self.metrics.set(
            num_running_reqs=load.running,
            num_queue_reqs=load.waiting,
            num_used_tokens=load.used_tokens,
            token_usage=load.token_usage,
            cache_hit_rate=self.cache_hit_rate,
            kv_free_pages=load.free_pages,
            kv_cached_pages=load.cached_pages,
            kv_used_pages=load.used_pages,
            **load.disk,
        )
