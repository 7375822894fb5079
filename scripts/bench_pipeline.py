"""Pipeline parallelism: PP=2 throughput with micro-batching against one batch in flight.

    python scripts/bench_pipeline.py [--model-path P] [--tokenizer-path P] [--pp 2] [--tp 1] \\
        [--dtype bfloat16] [--max-total-tokens 16384] [--num-prompts 32] [--input-len 128] \\
        [--output-len 64] [--max-concurrency 32] [--seed 0] [--rounds 2] [--no-single-rank] [--json out.json]

Configurations, side by side as scripts/bench_configs.py describes (fresh servers, the same seeded
workload, alternating order over --rounds, medians):

    one batch in flight   --pp-size N --pp-micro-batches 1: the stages take turns (the baseline)
    micro-batching        --pp-size N: N micro-batches in flight, every stage busy
    no pipeline           --pp-size 1 --tp-size T: the same model on one stage, for reference

On this 2-core machine each of the two PP ranks gets one core (torch threads per rank = cores /
local ranks), so one batch in flight leaves a core idle while micro-batching keeps both busy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from bench_configs import add_common_args, check_common_args, compare  # noqa: E402

RATIO_LINE = "throughput of {config}: {ratio} of {baseline}"


def configs(pp: int, single_rank: bool) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {
        "one batch in flight": ("--pp-micro-batches", "1"),
        "micro-batching": (),
    }
    if single_rank:
        out["no pipeline"] = ("--pp-size", "1")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, num_prompts=32, input_len=128, output_len=64, max_concurrency=32)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--tp", type=int, default=1, help="TP ranks per stage (default 1)")
    parser.add_argument("--no-single-rank", action="store_true", help="skip the --pp-size 1 reference")
    args = parser.parse_args(argv)
    check_common_args(parser, args, positive=("pp", "tp"))
    if args.pp < 2:
        parser.error(f"--pp must be >= 2, got {args.pp}")
    args.server_args = ["--pp-size", str(args.pp), "--tp-size", str(args.tp)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return compare(args, configs(args.pp, not args.no_single_rank), RATIO_LINE, "bench_pipeline")


if __name__ == "__main__":
    sys.exit(main())
