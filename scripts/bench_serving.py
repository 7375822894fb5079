"""Online serving benchmark against a running srt server (SGLang's bench_serving, simplified).

    python scripts/bench_serving.py [--base-url http://127.0.0.1:30000 | --host H --port P] \\
        --num-prompts 200 --random-input-len 1024 --random-output-len 128 [--random-range-ratio 0.5] \\
        [--max-concurrency 16] [--request-rate 4] [--seed 0] [--disable-stream] [--json out.json]

Prompts are seeded random token ids in [10, vocab_size) (vocab_size from /server_info), sent as
`input_ids` with greedy sampling and `ignore_eos`, so every request makes exactly its output length.
Requests arrive all at once (--request-rate inf) or as a seeded Poisson process, and at most
--max-concurrency are in flight. Streaming (the default) measures TTFT and inter-token latency;
every request is bounded by --request-timeout, so the run always ends. Exit status 1 when no request
succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

DEFAULT_VOCAB_SIZE = 32000
MIN_TOKEN_ID = 10  # skip the low ids, where special tokens usually live
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


# ---- metrics: pure functions of the recorded timings ----
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
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s, input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        ttft_ms=latency_stats(ttfts), itl_ms=latency_stats(itls), e2e_ms=latency_stats([r.latency for r in ok]),
        errors=[r.error for r in results if not r.success])


def format_report(m: BenchMetrics) -> str:
    rows = [("Successful requests:", f"{m.completed}"), ("Failed requests:", f"{m.failed}"),
            ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
            ("Total input tokens:", f"{m.total_input_tokens}"), ("Total generated tokens:", f"{m.total_output_tokens}"),
            ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
            ("Input token throughput (tok/s):", f"{m.input_throughput:.2f}"),
            ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")]
    lines = [" Serving Benchmark Result ".center(60, "=")] + [f"{k:<44}{v:>16}" for k, v in rows]
    lines += [" Latency (ms) ".center(60, "-"), f"{'':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, stats in (("TTFT", m.ttft_ms), ("ITL", m.itl_ms), ("E2E latency", m.e2e_ms)):
        cells = [f"{v:>10.2f}" for v in (stats.mean, stats.p50, stats.p90, stats.p99)] if stats else [f"{'n/a':>10}"] * 4
        lines.append(f"{name:<20}{''.join(cells)}")
    lines.append("=" * 60)
    if m.errors:
        lines.append(f"First errors ({min(len(m.errors), SHOWN_ERRORS)} of {len(m.errors)}):")
        lines += [f"  {e}" for e in m.errors[:SHOWN_ERRORS]]
    return "\n".join(lines)


# ---- workload ----
def random_lengths(n: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Uniform in [length * range_ratio, length] (at least 1); range_ratio 1.0 gives fixed lengths."""
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


def random_prompts(lengths: list[int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}, got {vocab_size}")
    return [[rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)] for n in lengths]


def arrival_offsets(n: int, request_rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of a Poisson process at request_rate; all zero when infinite."""
    if math.isinf(request_rate):
        return [0.0] * n
    offsets, now = [], 0.0
    for _ in range(n):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


# ---- client ----
async def send_request(client: httpx.AsyncClient, url: str, input_ids: list[int], output_len: int,
                       stream: bool, result: RequestResult) -> None:
    """Fill `result` in place, so a timeout still leaves what arrived; raises on transport errors."""
    payload = {"input_ids": input_ids, "stream": stream,
               "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    final: dict[str, Any] | None = None
    if stream:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    result.error = f"stream error: {error.get('message') if isinstance(error, dict) else error}"
                    return
                new_tokens = len(chunk["output_ids"]) - result.output_len
                if new_tokens > 0:
                    result.chunk_times.append(time.perf_counter() - start)
                    result.chunk_tokens.append(new_tokens)
                    result.output_len += new_tokens
                final = chunk
            else:
                result.error = "the stream ended without data: [DONE]"
                return
    else:
        response = await client.post(url, json=payload)
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:300]}"
            return
        final = response.json()
        result.output_len = len(final["output_ids"])
    result.latency = time.perf_counter() - start
    finish = final["meta_info"]["finish_reason"] if final else None
    if final is None or finish is None or finish.get("type") == "abort":
        result.error = f"the request did not finish normally (finish_reason {finish})"
        return
    result.success = True


async def run_one(client: httpx.AsyncClient, url: str, input_ids: list[int], output_len: int, stream: bool,
                  timeout_s: float, semaphore: asyncio.Semaphore | None) -> RequestResult:
    result = RequestResult(prompt_len=len(input_ids))
    if semaphore is not None:
        await semaphore.acquire()
    try:
        await asyncio.wait_for(send_request(client, url, input_ids, output_len, stream, result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s} s"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:  # counted, not hidden
        result.error = f"{type(error).__name__}: {error}"
    finally:
        if semaphore is not None:
            semaphore.release()
    return result


async def fetch_vocab_size(client: httpx.AsyncClient, base_url: str) -> int:
    """/server_info's vocab_size, or DEFAULT_VOCAB_SIZE (with a note) when the server does not say."""
    response = await client.get(f"{base_url}/server_info")
    try:
        info = response.json() if response.status_code == 200 else {}
    except ValueError:
        info = {}
    vocab_size = info.get("vocab_size") if isinstance(info, dict) else None
    if isinstance(vocab_size, int) and vocab_size > MIN_TOKEN_ID:
        return vocab_size
    print(f"/server_info gave no vocab_size (HTTP {response.status_code}); using {DEFAULT_VOCAB_SIZE}", flush=True)
    return DEFAULT_VOCAB_SIZE


async def benchmark(args: argparse.Namespace) -> tuple[BenchMetrics, dict[str, Any]]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        vocab_size = await fetch_vocab_size(client, args.base_url)
        input_lens = random_lengths(args.num_prompts, args.random_input_len, args.random_range_ratio, rng)
        output_lens = random_lengths(args.num_prompts, args.random_output_len, args.random_range_ratio, rng)
        prompts = random_prompts(input_lens, vocab_size, rng)
        offsets = arrival_offsets(args.num_prompts, args.request_rate, rng)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        url = f"{args.base_url}/generate"
        print(f"{args.num_prompts} prompts, vocab {vocab_size}, request rate {args.request_rate}, "
              f"max concurrency {args.max_concurrency or 'unlimited'}, stream {not args.disable_stream}", flush=True)
        start = time.perf_counter()
        tasks = []
        for ids, out_len, offset in zip(prompts, output_lens, offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(run_one(client, url, ids, out_len, not args.disable_stream,
                                                     args.request_timeout, semaphore)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    metrics = compute_metrics(results, duration)
    details = {"input_lens": input_lens, "output_lens": [r.output_len for r in results],
               "ttfts_s": [r.ttft for r in results], "latencies_s": [r.latency for r in results],
               "vocab_size": vocab_size}
    return metrics, details


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=1.0,
                        help="lengths are uniform in [len * ratio, len]; 1.0 = fixed")
    parser.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson; default inf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--disable-stream", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:  # also rejects nan
        parser.error(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
    if not 0 < args.request_timeout < math.inf:
        parser.error(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        metrics, details = asyncio.run(benchmark(args))
    except httpx.HTTPError as error:
        print(f"bench_serving: cannot reach the server at {args.base_url}: {error!r}", file=sys.stderr)
        return 1
    print(format_report(metrics), flush=True)
    if args.json is not None:
        config = {k: (str(v) if isinstance(v, Path) or (isinstance(v, float) and math.isinf(v)) else v)
                  for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, **asdict(metrics), **details}, indent=2))
    return 0 if metrics.completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
