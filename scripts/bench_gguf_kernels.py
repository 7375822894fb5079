"""The GGUF block kernels against the bf16 copy, one layer at a time, streaming from memory.

    python scripts/bench_gguf_kernels.py [--n 640] [--k 2048] [--rows 1 2 4 8] [--copies 64] [--rounds 2]

A decode step reads each layer's weight once, from memory, not from cache; so each kind is timed
over `--copies` distinct copies of one [n, k] weight (64 copies of a 640 x 2048 layer are 168 MB in
bf16, past this CPU's caches), and the table gives microseconds per layer call, the best of 3 passes,
for each round: srt_bf16_linear on the bf16 copy (what a layer without a block kernel runs), and
srt_q4k_linear (Q4_K), srt_q5k_linear (Q5_K), srt_q8_linear (Q8_0, Q5_0, Q4_0) and srt_q6k_linear
(Q6_K) on their packed blocks, with each one's speed-up over bf16. The weights are random; the
kernels' cost does not depend on the values. The row limits in model_executor/cpu/kernels/ops.py
(Q4_MAX_ROWS, Q5K_MAX_ROWS, Q8_MAX_ROWS, Q6K_MAX_ROWS) come from tables like this one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from model_executor.cpu.kernels import build, ops, packing


def best_us(calls: list[Callable[[], object]], passes: int = 3) -> float:
    for call in calls:
        call()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, (time.perf_counter() - start) / len(calls) * 1e6)
    return best


def weights(n: int, k: int, copies: int) -> dict[str, list[torch.Tensor]]:
    """`copies` packed copies of a random [n, k] weight of each kind."""
    g = torch.Generator().manual_seed(0)
    bf16 = packing.bf16_pack(torch.randn(n, k, generator=g).bfloat16())
    q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q4k = packing.q4_pack(q4, torch.rand(n, k // 32, generator=g), -torch.rand(n, k // 32, generator=g))
    q5 = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    q5k = packing.q5k_pack(q5, torch.rand(n, k // 32, generator=g), -torch.rand(n, k // 32, generator=g))
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q8_0 = packing.q8_pack(q8, torch.rand(n, k // 32, generator=g).half())
    q6 = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    q6k = packing.q8_pack(q6, torch.rand(n, k // 16, generator=g))
    kinds = {"bf16": bf16, "Q4_K": q4k, "Q5_K": q5k, "Q8_0": q8_0, "Q6_K": q6k}
    return {kind: [w.clone() for _ in range(copies)] for kind, w in kinds.items()}


def call(kind: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    if kind == "bf16":
        return lambda: ops.bf16_linear(x, w, None, torch.bfloat16)
    if kind in ("Q4_K", "Q5_K"):
        return lambda: ops.q4_linear(x, w, None)
    return lambda: ops.q8_linear(x, w)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=640, help="outputs (a multiple of 32)")
    parser.add_argument("--k", type=int, default=2048, help="inputs (a multiple of 256)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--copies", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not (build.bf16_linear_available() and build.q5k_available() and build.q8_available()):
        raise SystemExit(f"the block kernels do not all run here: {build.describe_paths()}")
    print(build.describe_paths())
    print(f"layer {args.n} x {args.k}, {args.copies} copies; microseconds per call (speed-up over bf16)")
    packed = weights(args.n, args.k, args.copies)
    kinds = list(packed)
    print("rows | round | " + " | ".join(f"{kind:>14}" for kind in kinds))
    for rows in args.rows:
        x = torch.randn(rows, args.k).bfloat16()
        for r in range(args.rounds):
            us = {kind: best_us([call(kind, x, w) for w in packed[kind]]) for kind in kinds}
            cells = [f"{us[kind]:8.1f} ({us['bf16'] / us[kind]:.2f}x)" for kind in kinds]
            print(f"{rows:4d} | {r + 1:5d} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
