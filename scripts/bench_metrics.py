"""Serving benchmark metrics: what each request recorded, the figures derived from it, and the text
reports (one run in detail, a concurrency sweep as a table). Pure functions of recorded timings,
shared by bench_serving.py and compare_peers.py."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

SHOWN_ERRORS = 5


@dataclass
class RequestResult:
    """What one request recorded. Times are seconds since the request was sent."""

    prompt_len: int
    output_len: int = 0  # tokens received
    success: bool = False
    latency: float = 0.0  # end to end
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk with new tokens
    chunk_tokens: list[int] = field(default_factory=list)  # new tokens in that chunk
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float  # tok/s
    ttft_ms: LatencyStats | None  # None when nothing was streamed
    itl_ms: LatencyStats | None
    e2e_ms: LatencyStats | None
    errors: list[str]


@dataclass(frozen=True)
class LevelResult:
    """One run of the workload with at most `concurrency` requests in flight (None: no limit)."""

    concurrency: int | None
    metrics: BenchMetrics
    results: list[RequestResult]

    @property
    def label(self) -> str:
        return "unlimited" if self.concurrency is None else str(self.concurrency)

    def to_json(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            **asdict(self.metrics),
            "input_lens": [r.prompt_len for r in self.results],
            "output_lens": [r.output_len for r in self.results],
            "ttfts_s": [r.ttft for r in self.results],
            "latencies_s": [r.latency for r in self.results],
        }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(seconds: list[float]) -> LatencyStats | None:
    if not seconds:
        return None
    ms = [s * 1000 for s in seconds]
    return LatencyStats(statistics.fmean(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


def inter_token_latencies(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """One latency per token after the first chunk: a chunk carrying n tokens that came `gap` after
    the previous chunk contributes n values of gap / n (the server may coalesce decode steps)."""
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError(f"{len(chunk_times)} chunk times but {len(chunk_tokens)} token counts")
    itls: list[float] = []
    for prev, now, n in zip(chunk_times, chunk_times[1:], chunk_tokens[1:]):
        if n < 1:
            raise ValueError(f"a chunk must carry at least one new token, got {n}")
        itls.extend([(now - prev) / n] * n)
    return itls


def compute_metrics(results: list[RequestResult], duration_s: float) -> BenchMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [itl for r in ok for itl in inter_token_latencies(r.chunk_times, r.chunk_tokens)]
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        ttft_ms=latency_stats(ttfts),
        itl_ms=latency_stats(itls),
        e2e_ms=latency_stats([r.latency for r in ok]),
        errors=[r.error for r in results if not r.success],
    )


def format_report(m: BenchMetrics) -> str:
    rows = [
        ("Successful requests:", f"{m.completed}"),
        ("Failed requests:", f"{m.failed}"),
        ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        ("Total input tokens:", f"{m.total_input_tokens}"),
        ("Total generated tokens:", f"{m.total_output_tokens}"),
        ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
        ("Input token throughput (tok/s):", f"{m.input_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
    ]
    lines = [" Serving Benchmark Result ".center(60, "=")] + [f"{k:<44}{v:>16}" for k, v in rows]
    lines += [" Latency (ms) ".center(60, "-"), f"{'':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, stats in (("TTFT", m.ttft_ms), ("ITL", m.itl_ms), ("E2E latency", m.e2e_ms)):
        cells = (
            [f"{v:>10.2f}" for v in (stats.mean, stats.p50, stats.p90, stats.p99)]
            if stats
            else [f"{'n/a':>10}"] * 4
        )
        lines.append(f"{name:<20}{''.join(cells)}")
    lines.append("=" * 60)
    if m.errors:
        lines.append(f"First errors ({min(len(m.errors), SHOWN_ERRORS)} of {len(m.errors)}):")
        lines += [f"  {e}" for e in m.errors[:SHOWN_ERRORS]]
    return "\n".join(lines)


SWEEP_COLUMNS = (
    "concurrency",
    "completed",
    "failed",
    "req/s",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "E2E p50",
    "E2E p99",
)


def _ms(stats: LatencyStats | None, name: str) -> str:
    return "n/a" if stats is None else f"{getattr(stats, name):.2f}"


def format_sweep_table(levels: list[LevelResult], title: str) -> str:
    """One row per concurrency level; latencies in milliseconds."""
    widths = [max(len(c), 9) for c in SWEEP_COLUMNS]
    header = "  ".join(f"{c:>{w}}" for c, w in zip(SWEEP_COLUMNS, widths))
    lines = [f" {title} ".center(len(header), "="), header, "-" * len(header)]
    for level in levels:
        m = level.metrics
        cells = [
            level.label,
            str(m.completed),
            str(m.failed),
            f"{m.request_throughput:.2f}",
            f"{m.output_throughput:.2f}",
            _ms(m.ttft_ms, "p50"),
            _ms(m.ttft_ms, "p99"),
            _ms(m.itl_ms, "p50"),
            _ms(m.itl_ms, "p99"),
            _ms(m.e2e_ms, "p50"),
            _ms(m.e2e_ms, "p99"),
        ]
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append("latencies in ms (TTFT: time to first token; ITL: inter-token; E2E: end to end)")
    return "\n".join(lines)
