"""Server configurations measured side by side: the machinery of bench_guards.py and bench_pipeline.py.

For each configuration (a list of extra launch_server flags) a fresh server is started, sent one
warmup request, then the same seeded bench_serving workload; its output token throughput and mean
inter-token latency are recorded and the server is stopped. The whole set runs --rounds times,
every other round in reverse order (ABCD DCBA ...), so load from other processes that drifts over
the run falls on every configuration alike; the median per configuration is reported with its ratio
to the first configuration (the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
for path in (SCRIPTS, SCRIPTS.parent):  # the sibling bench modules, and this checkout installed or not
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_serving  # noqa: E402
from bench_clients import HTTP_ERRORS, http_call  # noqa: E402

from srt.server_process import ServerProcess  # noqa: E402


# ---- one measurement ----
@dataclass(frozen=True)
class Run:
    config: str
    round: int
    output_throughput: float  # tok/s
    mean_itl_ms: float | None  # None when no request streamed two chunks
    completed: int
    failed: int


def warmup(url: str, input_len: int) -> None:
    """One short request, so the first timed request does not pay for lazy initialisation."""
    payload = {
        "input_ids": [bench_serving.MIN_TOKEN_ID] * input_len,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    }
    response = http_call(f"{url}/generate", timeout_s=300, json_body=payload)
    if response.status != 200:
        raise RuntimeError(f"the warmup request failed: HTTP {response.status}: {response.text[:300]}")


def measure(config: str, flags: Sequence[str], round_index: int, args: argparse.Namespace) -> Run:
    """`args`: the common arguments (add_common_args) plus `server_args`, the flags every
    configuration shares (a configuration's own flags come after them and win)."""
    server_args = [
        *args.server_args,
        "--dtype",
        args.dtype,
        "--max-total-tokens",
        str(args.max_total_tokens),
        *flags,
    ]
    if args.model_path is not None:
        server_args += ["--model-path", args.model_path]
    if args.tokenizer_path is not None:
        server_args += ["--tokenizer-path", args.tokenizer_path]
    print(f"--- round {round_index + 1}/{args.rounds}: {config} ---", flush=True)
    with ServerProcess(server_args, args.startup_timeout) as server:
        warmup(server.url, args.input_len)
        bench_args = bench_serving.parse_args(
            [
                "--base-url",
                server.url,
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--max-concurrency",
                str(args.max_concurrency),
                "--seed",
                str(args.seed),
                "--request-timeout",
                str(args.request_timeout),
            ]
        )
        metrics, _ = asyncio.run(bench_serving.benchmark(bench_args))
    itl = metrics.itl_ms.mean if metrics.itl_ms is not None else None
    run = Run(config, round_index, metrics.output_throughput, itl, metrics.completed, metrics.failed)
    print(
        f"{config}: {run.output_throughput:.2f} tok/s, mean ITL {_ms(itl)}, "
        f"{run.completed} completed, {run.failed} failed",
        flush=True,
    )
    for error in metrics.errors[: bench_serving.SHOWN_ERRORS]:
        print(f"  {error}", flush=True)
    return run


# ---- summary: pure functions ----
def round_orders(configs: list[str], rounds: int) -> list[list[str]]:
    """ABCD, DCBA, ABCD, ...: a linear drift in machine load cancels over each pair of rounds."""
    return [list(configs) if r % 2 == 0 else list(reversed(configs)) for r in range(rounds)]


def summarize(runs: list[Run], configs: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """Per configuration (name -> flags), the median throughput and mean ITL over rounds, and the
    throughput ratio to the baseline (the first configuration)."""
    rows: list[dict[str, Any]] = []
    for config, flags in configs.items():
        mine = [r for r in runs if r.config == config]
        if not mine:
            raise ValueError(f"no runs of {config!r}")
        itls = [r.mean_itl_ms for r in mine if r.mean_itl_ms is not None]
        rows.append(
            {
                "config": config,
                "flags": list(flags),
                "output_throughput": statistics.median(r.output_throughput for r in mine),
                "mean_itl_ms": statistics.median(itls) if itls else None,
                "runs": [asdict(r) for r in mine],
            }
        )
    baseline = rows[0]["output_throughput"]
    for row in rows:
        row["ratio"] = row["output_throughput"] / baseline if baseline > 0 else None
    return rows


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_table(rows: list[dict[str, Any]], ratio_line: str) -> str:
    """`ratio_line`: one line per non-baseline row, formatted with {config}, {ratio}, {baseline}."""
    width = max([20] + [len(str(row["config"])) + 2 for row in rows])
    header = f"{'config':<{width}}{'output tok/s':>14}{'mean ITL ms':>14}{'ratio vs baseline':>20}"
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(
            f"{row['config']:<{width}}{row['output_throughput']:>14.2f}{_ms(row['mean_itl_ms']):>14}"
            f"{ratio:>20}"
        )
    lines += [
        ratio_line.format(
            config=row["config"],
            baseline=rows[0]["config"],
            ratio="n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x",
        )
        for row in rows[1:]
    ]
    return "\n".join(lines)


# ---- CLI ----
def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_concurrency: int,
) -> None:
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer-path", default=None, help="default: --model-path")
    parser.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=input_len)
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--max-concurrency", type=int, default=max_concurrency)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server start")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


def check_common_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, positive: Sequence[str] = ()
) -> None:
    for name in (
        "max_total_tokens",
        "num_prompts",
        "input_len",
        "output_len",
        "max_concurrency",
        "rounds",
        *positive,
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("startup_timeout", "request_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")


def compare(
    args: argparse.Namespace, configs: Mapping[str, Sequence[str]], ratio_line: str, name: str
) -> int:
    """Runs every configuration --rounds times, prints the table; the exit status."""
    runs: list[Run] = []
    try:
        for round_index, order in enumerate(round_orders(list(configs), args.rounds)):
            runs += [measure(config, configs[config], round_index, args) for config in order]
    except HTTP_ERRORS + (RuntimeError,) as error:
        print(f"{name}: {error}", file=sys.stderr)
        return 1
    rows = summarize(runs, configs)
    print(format_table(rows, ratio_line), flush=True)
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "results": rows}, indent=2))
    return 0 if all(r.completed > 0 for r in runs) else 1
