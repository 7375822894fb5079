"""Constrained against unconstrained decoding: decode throughput at batch 1 and 32, one server, one run.

Each measurement is one /generate batch of `--batch` identical-length requests (greedy), run twice:
with `max_new_tokens` N and with 1 (the prefill alone); decode throughput is batch x (N - 1)
tokens over the difference. Every request runs all N tokens: the unconstrained and the regex
requests ban EOS with min_new_tokens = N, and the JSON schema's string has a minLength the output
cannot reach, so nothing ends early. Modes alternate within each round, so a slow phase of the
machine hits all of them; the table shows the median of `--rounds` and each mode's ratio to
unconstrained at the same batch.

    python scripts/bench_constrained.py [--model-path DIR] [--rounds 3] [--output-len 32] [-- server args]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_clients import http_call  # noqa: E402

from srt.server_process import ServerProcess  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "unconstrained": {},
    "regex": {"regex": r"[a-z ,.]+"},
    "json_schema": {
        "json_schema": json.dumps(
            {
                "type": "object",
                "properties": {"story": {"type": "string", "minLength": 4096}},
                "required": ["story"],
            }
        )
    },
}
BATCHES = (1, 32)
PROMPT_LEN = 32


def timed_batch(server: ServerProcess, batch: int, new_tokens: int, grammar: dict[str, Any]) -> float:
    prompts = [[(7 * i + j) % 5000 + 100 for j in range(PROMPT_LEN)] for i in range(batch)]
    params = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "temperature": 0, **grammar}
    start = time.perf_counter()
    answer = http_call(
        f"{server.url}/generate", timeout_s=1800, json_body={"input_ids": prompts, "sampling_params": params}
    )
    elapsed = time.perf_counter() - start
    if answer.status != 200:
        raise RuntimeError(f"/generate answered {answer.status}: {answer.body[:500]!r}")
    outs = json.loads(answer.body)
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        if reason["type"] != "length" or out["meta_info"]["completion_tokens"] != new_tokens:
            raise RuntimeError(
                f"a request ended early ({reason}); the measurement needs all {new_tokens} tokens"
            )
    return elapsed


def decode_throughput(server: ServerProcess, batch: int, output_len: int, grammar: dict[str, Any]) -> float:
    full = timed_batch(server, batch, output_len, grammar)
    prefill = timed_batch(server, batch, 1, grammar)
    return batch * (output_len - 1) / max(full - prefill, 1e-9)


def format_table(results: dict[tuple[int, str], list[float]]) -> str:
    lines = [f"{'batch':>5}  {'mode':<14} {'decode tok/s':>12}  {'vs unconstrained':>16}", "-" * 52]
    for batch in BATCHES:
        base = statistics.median(results[(batch, "unconstrained")])
        for mode in MODES:
            value = statistics.median(results[(batch, mode)])
            lines.append(f"{batch:>5}  {mode:<14} {value:>12.1f}  {value / base:>15.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("server_args", nargs="*", help="more launch_server arguments (after --)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.output_len < 2:
        parser.error("--output-len must be >= 2")
    server_args = (["--model-path", args.model_path] if args.model_path else []) + [
        "--max-running-requests",
        str(max(BATCHES)),
        *args.server_args,
    ]
    server = ServerProcess(server_args, startup_timeout_s=600)
    results: dict[tuple[int, str], list[float]] = {(b, m): [] for b in BATCHES for m in MODES}
    try:
        for grammar in MODES.values():  # warm-up: compile each grammar, touch each batch shape
            timed_batch(server, max(BATCHES), 2, grammar)
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for batch in BATCHES:
                for mode in order:
                    tput = decode_throughput(server, batch, args.output_len, MODES[mode])
                    results[(batch, mode)].append(tput)
                    print(f"round {r} batch {batch} {mode}: {tput:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        server.close()
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
