"""Prometheus metrics (--enable-metrics), served as text on GET /metrics.

Two sources, one page:

- The front end (main process) measures what a client sees, in its own registry:
  `srt:num_requests_total{finish_reason}`, `srt:prompt_tokens_total`, `srt:generation_tokens_total`,
  `srt:cached_tokens_total` (counters); `srt:time_to_first_token_seconds`,
  `srt:inter_token_latency_seconds`, `srt:e2e_request_latency_seconds` (histograms). With
  --restart-on-failure: `srt:engine_restarts_total`, `srt:replayed_requests_total` (counters) and
  `srt:recovery_seconds` (histogram: from the failure to the replays sent; srt/recovery.py).
- The scheduler ranks write theirs with prometheus_client's multiprocess mode: each process keeps
  its values in small mmap'd files under `<ipc dir>/metrics`, and /metrics merges them at scrape
  time. No message and no collective is added to the step loop; a rank's write is a few
  microseconds. Every rank: `srt:forward_steps_total{rank}` and
  `srt:last_forward_step_timestamp_seconds{rank}` (unix time; what a hang alert watches);
  `srt:step_broadcast_seconds_total{rank}`, `srt:step_schedule_seconds_total{rank}`,
  `srt:step_forward_seconds_total{rank}` (where busy steps spend their time: receive + broadcast,
  scheduling, forward + sample; scheduler/stats.py StepTimer); `srt:token_sync_steps_total{rank}`
  (steps whose sampled ids were MIN-all-reduced over TP: with --sync-token-ids-across-tp, or a
  grammar in the batch); a mixture of experts' `srt:moe_expert_tokens{rank,expert}` and
  `srt:moe_routing_skew{rank}` (gauges, every --decode-log-interval steps). The output rank:
  `srt:num_running_reqs`, `srt:num_queue_reqs`, `srt:num_used_tokens`, `srt:token_usage` (KV held
  by requests / KV capacity), `srt:cache_hit_rate` (prompt tokens served from the prefix cache /
  prompt tokens, since start), `srt:gen_throughput` (tokens/s, at the last decode stats log),
  `srt:kv_free_pages`, `srt:kv_cached_pages`, `srt:kv_used_pages`.
- The front end also reads, when scraped, `srt:process_resident_memory_bytes{process}` of every
  process of node 0 and `srt:host_available_memory_bytes` (srt/memory_watch.py).

Each node's ranks write under that node's ipc directory; the other nodes' launchers publish
theirs in the rendezvous store (launcher/metrics_relay.py) and node 0's /metrics merges them in,
so it shows every rank of a multi-node server.

SGLang's names too: the series a router, autoscaler or dashboard made for SGLang reads
(`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, `sglang:num_used_tokens`,
`sglang:cache_hit_rate`, `sglang:gen_throughput`, `sglang:num_requests_total`, the token counters and
the three latency histograms, plus `sglang:max_total_num_tokens`) are the srt: series above under
SGLang's name with SGLang's `model_name` label, copied when /metrics is scraped (SGLANG_MIRRORED).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from srt.server_args import PortArgs

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 120)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.8, 1, 2, 4)
RECOVERY_BUCKETS = (1, 2, 4, 6, 8, 10, 15, 20, 30, 45, 60, 90, 120, 300)
E2E_BUCKETS = (0.05, 0.1, 0.2, 0.4, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 120, 300, 600)
HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"  # /health_generate's probes are not user traffic
# srt: series that also appear under SGLang's name (sglang:<name>, with a model_name label)
SGLANG_MIRRORED = (
    "num_running_reqs",
    "num_queue_reqs",
    "num_used_tokens",
    "token_usage",
    "cache_hit_rate",
    "gen_throughput",
    "num_requests",
    "prompt_tokens",
    "generation_tokens",
    "cached_tokens",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
)


def metrics_dir(port_args: PortArgs) -> Path:
    """Where the scheduler processes of this node write their metric files (removed with the
    ipc directory at shutdown)."""
    return Path(port_args.tokenizer_ipc.removeprefix("ipc://")).parent / "metrics"


def enable_multiprocess_metrics(directory: Path) -> None:
    """In a scheduler process, before it creates any metric: values go to mmap'd files in
    `directory` (prometheus_client's multiprocess mode) for the front end to read."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue()


# The prompt cache on disk (--enable-hierarchical-cache, mem_cache/disk_tier.py), as the output rank
# sees it: hits are agreed over the world, the rest are that rank's own files
DISK_GAUGES = {
    "disk_hit_tokens": "Tokens restored from the prompt cache on disk (every rank had them), since start",
    "disk_read_blocks": "Blocks this rank read whole from the disk tier, since start",
    "disk_bad_blocks": "Short, corrupt or foreign disk tier files this rank deleted (each a miss), since start",
    "disk_written_blocks": "Blocks this rank wrote to the disk tier, since start",
    "disk_dropped_writes": "Writes to the disk tier dropped with the writer's queue full, since start",
    "disk_evicted_blocks": "Disk tier files this rank deleted for the size bound, since start",
    "disk_bytes": "Bytes of this rank's disk tier files",
    "disk_read_seconds": "Seconds this rank spent reading the disk tier, since start",
    "disk_write_seconds": "Seconds this rank's writer spent writing the disk tier, since start",
}


class RankMetrics:
    """A scheduler rank's series (create after enable_multiprocess_metrics)."""

    def __init__(self, rank: int, is_output_rank: bool) -> None:
        from prometheus_client import Counter, Gauge

        self.forward_steps = Counter("srt:forward_steps", "Forward steps run by this rank", ["rank"]).labels(
            str(rank)
        )
        self.last_step_time = Gauge(
            "srt:last_forward_step_timestamp_seconds",
            "Unix time of this rank's last forward step",
            ["rank"],
            multiprocess_mode="max",
        ).labels(str(rank))
        parts = {
            "broadcast": "receiving and broadcasting requests",
            "schedule": "scheduling",
            "forward": "the forward pass and sampling",
        }
        self.step_seconds = {
            part: Counter(
                f"srt:step_{part}_seconds", f"Seconds of this rank's busy steps in {doc}", ["rank"]
            ).labels(str(rank))
            for part, doc in parts.items()
        }
        self.token_sync_steps = Counter(
            "srt:token_sync_steps",
            "Steps whose sampled ids were MIN-all-reduced over "
            "TP (--sync-token-ids-across-tp, or a constrained request in the batch)",
            ["rank"],
        ).labels(str(rank))
        self.rank = str(rank)
        self.expert_tokens = Gauge(
            "srt:moe_expert_tokens",
            "Tokens routed to each expert since start, summed over this rank's mixture-of-experts layers",
            ["rank", "expert"],
            multiprocess_mode="mostrecent",
        )
        self.routing_skew = Gauge(
            "srt:moe_routing_skew",
            "Tokens routed to the busiest expert over the mean of all experts, since start, over this rank's "
            "mixture-of-experts layers (1: balanced)",
            ["rank"],
            multiprocess_mode="mostrecent",
        )
        self.is_output_rank = is_output_rank
        if not is_output_rank:
            return
        gauges = {
            "num_running_reqs": "Running requests",
            "num_queue_reqs": "Waiting requests",
            "num_used_tokens": "KV cache tokens held by requests",
            "token_usage": "Fraction of the KV cache held by requests",
            "cache_hit_rate": "Prompt tokens served from the prefix cache / prompt tokens, since start",
            "gen_throughput": "Generated tokens per second, at the last decode stats log",
            "kv_free_pages": "KV pages free",
            "kv_cached_pages": "KV pages held by the prefix cache",
            "kv_used_pages": "KV pages allocated (prefix cache and running requests)",
            "spec_accept_length": "Tokens a drafting request took per verify step (accepted drafts + 1), "
            "since start (--speculative-algorithm)",
        }
        self.gauges = {
            name: Gauge(f"srt:{name}", doc, multiprocess_mode="mostrecent")
            for name, doc in {**gauges, **DISK_GAUGES}.items()
        }

    def step(self) -> None:
        self.forward_steps.inc()
        self.last_step_time.set(time.time())

    def step_time(self, broadcast_s: float, schedule_s: float, forward_s: float) -> None:
        self.step_seconds["broadcast"].inc(broadcast_s)
        self.step_seconds["schedule"].inc(schedule_s)
        self.step_seconds["forward"].inc(forward_s)

    def experts(self, tokens: list[int]) -> None:
        """Tokens routed to each expert since start (a mixture-of-experts model)."""
        for expert, count in enumerate(tokens):
            self.expert_tokens.labels(self.rank, str(expert)).set(count)
        mean = sum(tokens) / len(tokens)
        self.routing_skew.labels(self.rank).set(max(tokens) / mean if mean else 0.0)

    def set(self, **values: float) -> None:
        for name, value in values.items():
            self.gauges[name].set(value)


@dataclass
class RequestTiming:
    """What the front end remembers of one request for its latency series (perf_counter times)."""

    created: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    completion_tokens: int = 0


class SGLangNames:
    """A collector that yields the SGLANG_MIRRORED families of `source` as sglang:<name>, each
    sample labelled model_name (SGLang's label), and sglang:max_total_num_tokens."""

    def __init__(self, source: Any, model_name: str, max_total_tokens: int | None) -> None:
        self.source = source
        self.model_name = model_name
        self.max_total_tokens = max_total_tokens

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, Metric

        wanted = {f"srt:{name}" for name in SGLANG_MIRRORED}
        for family in self.source.collect():
            if family.name not in wanted:
                continue
            copy = Metric("sglang:" + family.name.removeprefix("srt:"), family.documentation, family.type)
            for sample in family.samples:
                copy.add_sample(
                    "sglang:" + sample.name.removeprefix("srt:"),
                    {**sample.labels, "model_name": self.model_name},
                    sample.value,
                    sample.timestamp,
                )
            yield copy
        if self.max_total_tokens is not None:
            capacity = GaugeMetricFamily(
                "sglang:max_total_num_tokens", "KV cache capacity in tokens", labels=["model_name"]
            )
            capacity.add_metric([self.model_name], self.max_total_tokens)
            yield capacity


def render_rank_metrics(rank_metrics_dir: Path) -> bytes:
    """This node's ranks' series as Prometheus text (what a node > 0 relays to node 0)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(rank_metrics_dir))
    return generate_latest(registry)


class NodesCollector:
    """This node's ranks' series (their metric files) merged, family by family, with the texts
    the other nodes relayed (`remote`, set on node 0 of a multi-node server)."""

    def __init__(self, rank_metrics_dir: Path) -> None:
        self.dir = rank_metrics_dir
        self.remote: Callable[[], list[str]] | None = None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.multiprocess import MultiProcessCollector
        from prometheus_client.parser import text_string_to_metric_families

        families = {
            family.name: family for family in MultiProcessCollector(None, path=str(self.dir)).collect()
        }
        for text in self.remote() if self.remote is not None else []:
            for family in text_string_to_metric_families(text):
                mine = families.setdefault(family.name, family)
                if mine is not family:
                    mine.samples.extend(family.samples)
        yield from families.values()


class FrontendMetrics:
    """The front end's series, and the rendering of /metrics (its own + the ranks' files + both
    under SGLang's names)."""

    def __init__(
        self, rank_metrics_dir: Path, model_name: str = "default", max_total_tokens: int | None = None
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.sglang_registry = CollectorRegistry()
        self.sglang_registry.register(SGLangNames(self.registry, model_name, max_total_tokens))
        rank_metrics_dir.mkdir(parents=True, exist_ok=True)
        self.nodes = NodesCollector(rank_metrics_dir)  # its `remote` is set on node 0 of several nodes
        self.registry.register(self.nodes)
        r = self.registry
        self.requests = Counter("srt:num_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("srt:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("srt:generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "srt:cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "srt:time_to_first_token_seconds",
            "Time to the first output token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "srt:inter_token_latency_seconds", "Time between output tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "srt:e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "srt:engine_restarts", "Engine restarts after a rank or the detokenizer died", registry=r
        )
        self.replayed = Counter(
            "srt:replayed_requests", "Requests resubmitted after an engine restart", registry=r
        )
        self.recovery = Histogram(
            "srt:recovery_seconds",
            "From a failure to the restarted engine's replays",
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )

    def on_restart(self, replayed: int, seconds: float) -> None:
        self.restarts.inc()
        self.replayed.inc(replayed)
        self.recovery.observe(seconds)

    def on_tokens(self, rid: str, timing: RequestTiming, completion_tokens: int, now: float) -> None:
        """A request has `completion_tokens` output tokens at `now` (perf_counter)."""
        new = completion_tokens - timing.completion_tokens
        if new <= 0 or rid.startswith(HEALTH_CHECK_PREFIX):
            return
        if timing.first_token_time is None:
            timing.first_token_time = now
            self.ttft.observe(now - timing.created)
        else:
            gap = (now - timing.last_token_time) / new  # a chunk of k tokens: k gaps of elapsed / k
            for _ in range(new):
                self.itl.observe(gap)
        timing.last_token_time = now
        timing.completion_tokens = completion_tokens

    def on_finish(
        self,
        rid: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        latency_s: float,
    ) -> None:
        if rid.startswith(HEALTH_CHECK_PREFIX):
            return
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.e2e.observe(latency_s)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry) + generate_latest(self.sglang_registry), CONTENT_TYPE_LATEST
