"""Throughput cost of the TP guards: token-id sync and the rank-consensus checker.

    python scripts/bench_guards.py [--model-path P] [--tokenizer-path P] [--tp 2] [--dtype bfloat16] \\
        [--max-total-tokens 16384] [--num-prompts 32] [--input-len 64] [--output-len 32] \\
        [--max-concurrency 16] [--seed 0] [--rounds 2] [--json out.json]

For each configuration (baseline, --sync-token-ids-across-tp, --enable-rank-consensus-checker, both)
a fresh server is started, sent one warmup request, then the same seeded bench_serving workload;
its output token throughput and mean inter-token latency are recorded and the server is stopped.
The whole set runs --rounds times, every other round in reverse order (ABCD DCBA ...), so load from
other processes that drifts over the run falls on every configuration alike; the median per
configuration is reported. Exit status 1 when a server does not start or a run completes no request.

The bundled SmolLM2-135M has 9 attention heads (3 KV heads), so it runs at --tp 1 or 3, not 2; the
server refuses --tp 2 at start-up and this script exits 1 with that message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

SCRIPTS = Path(__file__).resolve().parent
for path in (SCRIPTS, SCRIPTS.parent):  # the sibling bench modules, and this checkout installed or not
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_serving  # noqa: E402
from server_process import SrtServer  # noqa: E402

CONFIGS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "token sync": ("--sync-token-ids-across-tp",),
    "consensus checker": ("--enable-rank-consensus-checker",),
    "both": ("--sync-token-ids-across-tp", "--enable-rank-consensus-checker"),
}


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
    payload = {"input_ids": [bench_serving.MIN_TOKEN_ID] * input_len,
               "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
    response = httpx.post(f"{url}/generate", json=payload, timeout=300, trust_env=False)
    if response.status_code != 200:
        raise RuntimeError(f"the warmup request failed: HTTP {response.status_code}: {response.text[:300]}")


def measure(config: str, round_index: int, args: argparse.Namespace) -> Run:
    server_args = ["--tp", str(args.tp), "--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens),
                   *CONFIGS[config]]
    if args.model_path is not None:
        server_args += ["--model-path", args.model_path]
    if args.tokenizer_path is not None:
        server_args += ["--tokenizer-path", args.tokenizer_path]
    print(f"--- round {round_index + 1}/{args.rounds}: {config} ---", flush=True)
    with SrtServer(server_args, args.startup_timeout) as server:
        warmup(server.url, args.input_len)
        bench_args = bench_serving.parse_args(
            ["--base-url", server.url, "--num-prompts", str(args.num_prompts),
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
             "--request-timeout", str(args.request_timeout)])
        metrics, _ = asyncio.run(bench_serving.benchmark(bench_args))
    itl = metrics.itl_ms.mean if metrics.itl_ms is not None else None
    run = Run(config, round_index, metrics.output_throughput, itl, metrics.completed, metrics.failed)
    print(f"{config}: {run.output_throughput:.2f} tok/s, mean ITL {_ms(itl)}, "
          f"{run.completed} completed, {run.failed} failed", flush=True)
    for error in metrics.errors[:bench_serving.SHOWN_ERRORS]:
        print(f"  {error}", flush=True)
    return run


# ---- summary: pure functions ----
def round_orders(configs: list[str], rounds: int) -> list[list[str]]:
    """ABCD, DCBA, ABCD, ...: a linear drift in machine load cancels over each pair of rounds."""
    return [list(configs) if r % 2 == 0 else list(reversed(configs)) for r in range(rounds)]


def summarize(runs: list[Run], configs: list[str]) -> list[dict[str, Any]]:
    """Per configuration, the median throughput and mean ITL over rounds, and the throughput ratio
    to the baseline (the first configuration)."""
    rows = []
    for config in configs:
        mine = [r for r in runs if r.config == config]
        if not mine:
            raise ValueError(f"no runs of {config!r}")
        itls = [r.mean_itl_ms for r in mine if r.mean_itl_ms is not None]
        rows.append({"config": config, "flags": list(CONFIGS.get(config, ())),
                     "output_throughput": statistics.median(r.output_throughput for r in mine),
                     "mean_itl_ms": statistics.median(itls) if itls else None,
                     "runs": [asdict(r) for r in mine]})
    baseline = rows[0]["output_throughput"]
    for row in rows:
        row["ratio"] = row["output_throughput"] / baseline if baseline > 0 else None
    return rows


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'config':<20}{'output tok/s':>14}{'mean ITL ms':>14}{'ratio vs baseline':>20}"
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(f"{row['config']:<20}{row['output_throughput']:>14.2f}{_ms(row['mean_itl_ms']):>14}{ratio:>20}")
    lines += [f"throughput cost of {row['config']}: "
              + ("n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x") + " of baseline"
              for row in rows[1:]]
    return "\n".join(lines)


# ---- CLI ----
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer-path", default=None, help="default: --model-path")
    parser.add_argument("--tp", type=int, default=3, help="TP size (default 3: the default SmolLM2 has 9 heads, so 2 does not divide)")
    parser.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server start")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("tp", "max_total_tokens", "num_prompts", "input_len", "output_len", "max_concurrency", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("startup_timeout", "request_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = list(CONFIGS)
    runs: list[Run] = []
    try:
        for round_index, order in enumerate(round_orders(configs, args.rounds)):
            runs += [measure(config, round_index, args) for config in order]
    except (RuntimeError, httpx.HTTPError) as error:
        print(f"bench_guards: {error}", file=sys.stderr)
        return 1
    rows = summarize(runs, configs)
    print(format_table(rows), flush=True)
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "results": rows}, indent=2))
    return 0 if all(r.completed > 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
