"""Online serving benchmark and concurrency sweep against a running server (SGLang's bench_serving, simplified).

    python scripts/bench_serving.py [--base-url http://127.0.0.1:30000 | --host H --port P] \\
        [--backend auto|srt|openai] [--model NAME] --num-prompts 64 --random-input-len 128 \\
        --random-output-len 64 [--random-range-ratio 0.5] [--concurrency 1 4 16 32] [--request-rate 4] \\
        [--seed 0] [--disable-stream] [--plot sweep.png] [--json out.json]

Prompts are seeded random token ids in [10, vocab_size) (vocab_size from srt's /server_info, else
--vocab-size), sent greedy with `ignore_eos`, so every request makes exactly its output length.
--backend srt uses srt's /generate; openai uses /v1/completions with streaming, so any
OpenAI-compatible server (vLLM, SGLang, srt) can be measured; auto picks srt when the server is srt.

For each --concurrency level the workload runs with at most that many requests in flight (no limit
when the flag is absent), on fresh prompts so that no level reuses another's prefix cache. Requests
arrive all at once (--request-rate inf) or as a seeded Poisson process. Streaming (the default)
measures TTFT and inter-token latency; every request is bounded by --request-timeout, so the run
always ends. A report per level, then one table row per level; --plot writes a PNG of throughput and
latency against concurrency. Exit status 1 when a level completes no request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))  # the sibling bench_* modules, however this file was loaded

import aiohttp  # noqa: E402
from bench_clients import BACKENDS, Target, open_session, resolve_target, run_one  # noqa: E402
from bench_metrics import (  # noqa: E402
    SHOWN_ERRORS,  # noqa: F401  (scripts/bench_guards.py reads it from here)
    BenchMetrics,
    LevelResult,
    compute_metrics,
    format_report,
    format_sweep_table,
)

DEFAULT_VOCAB_SIZE = 32000
MIN_TOKEN_ID = 10  # skip the low ids, where special tokens usually live
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    offsets: list[float]  # send times, s from the start


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


def make_workload(args: argparse.Namespace, vocab_size: int, rng: random.Random) -> Workload:
    input_lens = random_lengths(args.num_prompts, args.random_input_len, args.random_range_ratio, rng)
    output_lens = random_lengths(args.num_prompts, args.random_output_len, args.random_range_ratio, rng)
    prompts = random_prompts(input_lens, vocab_size, rng)
    return Workload(prompts, output_lens, arrival_offsets(args.num_prompts, args.request_rate, rng))


# ---- runs ----
async def run_level(
    target: Target, workload: Workload, concurrency: int | None, stream: bool, timeout_s: float
) -> LevelResult:
    """The workload with at most `concurrency` requests in flight (None: no limit)."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    async with open_session(timeout_s, limit=concurrency) as client:
        start = time.perf_counter()
        tasks = []
        for ids, out_len, offset in zip(workload.prompts, workload.output_lens, workload.offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(
                asyncio.create_task(run_one(client, target, ids, out_len, stream, timeout_s, semaphore))
            )
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return LevelResult(concurrency, compute_metrics(results, duration), results)


async def warmup(target: Target, prompts: list[list[int]], timeout_s: float) -> None:
    """Short untimed requests, one at a time, so the first level does not pay for lazy
    initialisation; raises RuntimeError when one fails (a wrong backend or model fails here)."""
    async with open_session(timeout_s) as client:
        for ids in prompts:
            result = await run_one(client, target, ids, WARMUP_OUTPUT_LEN, True, timeout_s, None)
            if not result.success:
                raise RuntimeError(f"the warmup request to {target.url} failed: {result.error}")


async def prepare(args: argparse.Namespace) -> tuple[Target, int]:
    """The target and the vocabulary size the prompts are drawn from."""
    async with open_session(60.0) as client:
        target, server_vocab = await resolve_target(client, args.base_url, args.backend, args.model)
    vocab_size = args.vocab_size or server_vocab
    if vocab_size is None:
        print(
            f"the server does not report its vocabulary size; drawing ids below {DEFAULT_VOCAB_SIZE} "
            "(pass --vocab-size)",
            flush=True,
        )
        vocab_size = DEFAULT_VOCAB_SIZE
    return target, vocab_size


async def sweep(args: argparse.Namespace) -> tuple[Target, int, list[LevelResult]]:
    target, vocab_size = await prepare(args)
    warm_rng = random.Random(f"warmup {args.seed}")  # its own stream: the levels' prompts do not depend on it
    await warmup(
        target,
        random_prompts([args.random_input_len] * args.warmup_requests, vocab_size, warm_rng),
        args.request_timeout,
    )
    rng = random.Random(args.seed)
    levels = []
    for concurrency in args.concurrency:
        workload = make_workload(args, vocab_size, rng)  # fresh prompts: no prefix-cache hits across levels
        print(
            f"{args.num_prompts} prompts, vocab {vocab_size}, backend {target.backend} ({target.url}), "
            f"request rate {args.request_rate}, max concurrency {concurrency or 'unlimited'}, "
            f"stream {not args.disable_stream}",
            flush=True,
        )
        level = await run_level(target, workload, concurrency, not args.disable_stream, args.request_timeout)
        print(format_report(level.metrics), flush=True)
        levels.append(level)
    return target, vocab_size, levels


async def benchmark(args: argparse.Namespace) -> tuple[BenchMetrics, dict[str, Any]]:
    """One level, no warmup: the entry point of callers such as scripts/bench_guards.py."""
    if len(args.concurrency) != 1:
        raise ValueError(f"benchmark runs one concurrency level, got {args.concurrency}")
    _, vocab_size, levels = await sweep(argparse.Namespace(**{**vars(args), "warmup_requests": 0}))
    return levels[0].metrics, {**levels[0].to_json(), "vocab_size": vocab_size}


# ---- command line ----
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="default: %(default)s")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="srt: /generate; openai: /v1/completions; auto (default): srt when the server is srt",
    )
    parser.add_argument(
        "--model", default=None, help="model name in OpenAI requests; default: the first of /v1/models"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt ids are drawn below this; default: the server's /server_info, else 32000",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=100, help="requests per concurrency level; default: %(default)s"
    )
    parser.add_argument(
        "--random-input-len", type=int, default=1024, help="prompt tokens; default: %(default)s"
    )
    parser.add_argument(
        "--random-output-len", type=int, default=128, help="output tokens; default: %(default)s"
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths are uniform in [len * ratio, len]; 1.0 (default) = fixed",
    )
    parser.add_argument(
        "--concurrency",
        "--max-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="levels of the sweep: at most this many requests in flight; default: no limit",
    )
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf (default): all at once"
    )
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="untimed short requests before the sweep; default: %(default)s",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request; default: %(default)s"
    )
    parser.add_argument("--disable-stream", action="store_true", help="no TTFT / ITL then")
    parser.add_argument(
        "--plot", type=Path, default=None, help="write a PNG of the sweep here (needs matplotlib)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    args.concurrency = args.concurrency or [None]
    if any(c is not None and c < 1 for c in args.concurrency):
        parser.error(f"--concurrency values must be >= 1, got {args.concurrency}")
    if not args.request_rate > 0:  # also rejects nan
        parser.error(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
    if not 0 < args.request_timeout < math.inf:
        parser.error(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.vocab_size is not None and args.vocab_size <= MIN_TOKEN_ID:
        parser.error(f"--vocab-size must be > {MIN_TOKEN_ID}, got {args.vocab_size}")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def write_json(
    path: Path, args: argparse.Namespace, target: Target, vocab_size: int, levels: list[LevelResult]
) -> None:
    config = {
        k: (str(v) if isinstance(v, Path) or (isinstance(v, float) and math.isinf(v)) else v)
        for k, v in vars(args).items()
    }
    report = {
        "config": config,
        "backend": target.backend,
        "url": target.url,
        "model": target.model,
        "vocab_size": vocab_size,
        "levels": [level.to_json() for level in levels],
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target, vocab_size, levels = asyncio.run(sweep(args))
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        print(f"bench_serving: cannot reach the server at {args.base_url}: {error!r}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError) as error:
        print(f"bench_serving: {error}", file=sys.stderr)
        return 1
    title = (
        f"{target.backend} backend, {args.num_prompts} prompts, input {args.random_input_len}, "
        f"output {args.random_output_len}"
    )
    print(format_sweep_table(levels, title), flush=True)
    if args.plot is not None:
        from bench_plot import plot_sweep

        plot_sweep(levels, args.plot, f"{title} ({target.base_url})", unlimited_x=args.num_prompts)
        print(f"plot written to {args.plot}", flush=True)
    if args.json is not None:
        write_json(args.json, args, target, vocab_size, levels)
    return 0 if all(level.metrics.completed > 0 for level in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
