"""Throughput cost of the TP guards: token-id sync and the rank-consensus checker.

    python scripts/bench_guards.py [--model-path P] [--tokenizer-path P] [--tp 2] [--dtype bfloat16] \\
        [--max-total-tokens 16384] [--num-prompts 32] [--input-len 64] [--output-len 32] \\
        [--max-concurrency 16] [--seed 0] [--rounds 2] [--json out.json]

The configurations (baseline, --sync-token-ids-across-tp, --enable-rank-consensus-checker, both)
run side by side as scripts/bench_configs.py describes: fresh servers, the same seeded workload,
alternating order over --rounds, medians. Exit status 1 when a server does not start or a run
completes no request.

The bundled SmolLM2-135M has 9 attention heads (3 KV heads), so it runs at --tp 1 or 3, not 2; the
server refuses --tp 2 at start-up and this script exits 1 with that message.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from bench_configs import (  # noqa: E402,F401  (Run and round_orders: tests/test_bench_guards.py)
    Run,
    add_common_args,
    check_common_args,
    compare,
    format_table,
    round_orders,
    summarize,
)

CONFIGS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "token sync": ("--sync-token-ids-across-tp",),
    "consensus checker": ("--enable-rank-consensus-checker",),
    "both": ("--sync-token-ids-across-tp", "--enable-rank-consensus-checker"),
}
RATIO_LINE = "throughput cost of {config}: {ratio} of {baseline}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, num_prompts=32, input_len=64, output_len=32, max_concurrency=16)
    parser.add_argument(
        "--tp",
        type=int,
        default=3,
        help="TP size (default 3: the default SmolLM2 has 9 heads, so 2 does not divide)",
    )
    args = parser.parse_args(argv)
    check_common_args(parser, args, positive=("tp",))
    args.server_args = ["--tp", str(args.tp)]
    return args


def main(argv: list[str] | None = None) -> int:
    return compare(parse_args(argv), CONFIGS, RATIO_LINE, "bench_guards")


if __name__ == "__main__":
    sys.exit(main())
