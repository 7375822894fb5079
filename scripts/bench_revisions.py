"""bench_one_batch on two revisions of srt, side by side in one run: did a change cost speed?

    python scripts/bench_revisions.py BASE [--head REV] [--rounds 4] -- --batch-size 1 16 --output-len 32

BASE (and --head, default: this checkout as it is, uncommitted changes included) is checked out in a
temporary git worktree; each round runs both revisions' own scripts/bench_one_batch.py with the
arguments after `--`, in alternating order (base first in even rounds, head first in odd ones), so
load from other processes falls on both alike. Prints, per batch size, the median over rounds of
each revision's prefill tokens/s and decode ms per step, and head / base. Each revision times its
own step (forward + sampling as its ModelRunner exposes them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(into), rev], check=True)
    return into


def run_bench(tree: Path, bench_args: list[str], out: Path) -> list[dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "scripts" / "bench_one_batch.py"), *bench_args, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    results: list[dict[str, float]] = json.loads(out.read_text())["srt"]
    return results


def medians(rounds: list[list[dict[str, float]]], key: str) -> dict[int, float]:
    sizes = sorted({int(r["batch_size"]) for results in rounds for r in results})
    return {
        bs: statistics.median(r[key] for results in rounds for r in results if int(r["batch_size"]) == bs)
        for bs in sizes
    }


def table(base: list[list[dict[str, float]]], head: list[list[dict[str, float]]]) -> str:
    lines = [
        "| batch | prefill tok/s base | head | head/base | decode ms/step base | head | head/base |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pb, ph = medians(base, "prefill_tok_s"), medians(head, "prefill_tok_s")
    db, dh = medians(base, "decode_ms_per_step"), medians(head, "decode_ms_per_step")
    for bs in pb:
        lines.append(
            f"| {bs} | {pb[bs]:.0f} | {ph[bs]:.0f} | {ph[bs] / pb[bs]:.3f} "
            f"| {db[bs]:.2f} | {dh[bs]:.2f} | {dh[bs] / db[bs]:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the revision to compare against (a commit, branch or tag)")
    parser.add_argument("--head", default=None, help="the other revision; default: this checkout as it is")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(own)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="srt-bench-revisions-") as tmp:
        tmp_path = Path(tmp)
        trees = {"base": worktree(args.base, tmp_path / "base")}
        trees["head"] = ROOT if args.head is None else worktree(args.head, tmp_path / "head")
        results: dict[str, list[list[dict[str, float]]]] = {"base": [], "head": []}
        try:
            for i in range(args.rounds):
                for name in ("base", "head") if i % 2 == 0 else ("head", "base"):
                    results[name].append(run_bench(trees[name], bench_args, tmp_path / f"{name}-{i}.json"))
                    print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(
                        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
                    )
    head_name = args.head or "this checkout"
    print(
        f"base {args.base}, head {head_name}; medians of {args.rounds} rounds, alternating; bench_one_batch {' '.join(bench_args)}"
    )
    print(table(results["base"], results["head"]))


if __name__ == "__main__":
    main()
