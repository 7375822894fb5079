"""Speculative decoding on and off, side by side: output tokens per second and the accept length of
`--speculative-algorithm NGRAM` against plain decoding, at several batch sizes, on two prompt sets.

    python scripts/bench_speculative.py [--batch-sizes 1 8 32] [--max-new-tokens 128] [--rounds 2]
        [--num-draft-tokens 12] [--model-path PATH]

Both sides are srt's offline Engine (the server's scheduler, in this process, TP=1) on the bundled
SmolLM2-135M-Instruct in bf16, one with speculation and one without; each call generates greedily
for every prompt of a set in batches of the batch size (a batch larger than the set repeats its
prompts), each batch admitted at once. The sets: "repetitive" asks to copy, edit or
continue text given in the prompt (code, lists, quotes), where the answer repeats the prompt;
"chat" asks general questions. Each round runs both sides at every batch size, alternating which
goes first and last (off, on, on, off, then on, off, off, on: the machine is shared and noisy, and
drifts); the table gives each side's median output tokens per second over its runs, the ratio, the accept length (tokens a drafting request took per verify step:
accepted drafts + 1) and whether both sides produced the same tokens (they must).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from srt.engine import Engine  # noqa: E402
from srt.sampling_params import SamplingParams  # noqa: E402

CODE = """def area(shape, size):
    if shape == "square":
        return size * size
    if shape == "circle":
        return 3.14159 * size * size
    raise ValueError(f"unknown shape {shape}")
"""
REPETITIVE = [
    f"Rename the function area to surface in this code and print the whole code again:\n{CODE}",
    f"Add a docstring to this function and show the full function:\n{CODE}",
    "Copy this list exactly: apples, pears, plums, figs, dates, limes, kiwis, grapes, melons, cherries.",
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Quote this passage word for word: It was the best of times, it was the worst of times, it was the "
    "age of wisdom, it was the age of foolishness.",
    "Continue the numbered list up to 20: 1. one 2. two 3. three 4. four 5. five",
    "Write the days of the week in order, one per line, then write them again in the same order.",
    "Rewrite this JSON with the key name changed to title: "
    '{"name": "srt", "version": 1, "tags": ["server", "cpu"], "ranks": 2}',
]
CHAT = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a neural network is in two sentences.",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Suggest a name for a pet cat.",
    "Why is the sky blue?",
]


def chat_ids(engine: Engine, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.output_ids) for o in outs]
    return seconds, sum(map(len, tokens)), tokens


def accept_totals(engine: Engine) -> tuple[int, int]:
    stats = engine.scheduler.stats if engine.scheduler is not None else None
    return (stats.verified_total, stats.taken_total) if stats is not None else (0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--model-path", default=None)
    args = parser.parse_args()

    engines = {
        "off": Engine(args.model_path, dtype="bfloat16"),
        "on": Engine(
            args.model_path,
            dtype="bfloat16",
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=args.num_draft_tokens,
        ),
    }
    sets = {"repetitive": chat_ids(engines["off"], REPETITIVE), "chat": chat_ids(engines["off"], CHAT)}
    warm = sets["chat"][:2]
    for engine in engines.values():
        run(engine, warm, 8)

    rates: dict[tuple[str, int, str], list[float]] = {}
    accepts: dict[tuple[str, int], list[tuple[int, int]]] = {}
    same: dict[tuple[str, int], bool] = {}
    accepts_seen: dict[tuple[str, int, int], bool] = {}
    for r in range(args.rounds):
        for name, prompts in sets.items():
            for bs in args.batch_sizes:
                # every prompt of the set, in batches of bs (the set cycled to fill a larger batch)
                batches = (
                    [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
                    if bs < len(prompts)
                    else [[prompts[i % len(prompts)] for i in range(bs)]]
                )
                order = ["off", "on", "on", "off"] if r % 2 == 0 else ["on", "off", "off", "on"]
                tokens: dict[str, Any] = {}
                for side in order:
                    before = accept_totals(engines[side])
                    seconds, n, tokens[side] = 0.0, 0, []
                    for batch in batches:
                        s, k, t = run(engines[side], batch, args.max_new_tokens)
                        seconds, n, tokens[side] = seconds + s, n + k, tokens[side] + t
                    rates.setdefault((name, bs, side), []).append(n / seconds)
                    if side == "on" and not accepts_seen.get((name, bs, r)):
                        accepts_seen[(name, bs, r)] = True
                        after = accept_totals(engines[side])
                        accepts.setdefault((name, bs), []).append(
                            (after[0] - before[0], after[1] - before[1])
                        )
                same[(name, bs)] = same.get((name, bs), True) and tokens["on"] == tokens["off"]
                print(
                    f"round {r + 1} {name:10s} batch {bs:3d}: off {statistics.median(rates[(name, bs, 'off')]):7.1f}"
                    f"  on {statistics.median(rates[(name, bs, 'on')]):7.1f} tok/s",
                    flush=True,
                )

    draft_tokens = engines["on"].args.num_draft_tokens
    print(
        f"\nSmolLM2-135M-Instruct bf16, greedy, {args.max_new_tokens} new tokens, NGRAM with "
        f"--speculative-num-draft-tokens {draft_tokens}, median of {2 * args.rounds} runs a side\n"
    )
    print("| set | batch | off (tok/s) | NGRAM (tok/s) | ratio | accept length | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in sets:
        for bs in args.batch_sizes:
            off = statistics.median(rates[(name, bs, "off")])
            on = statistics.median(rates[(name, bs, "on")])
            verified = sum(v for v, _ in accepts[(name, bs)])
            taken = sum(t for _, t in accepts[(name, bs)])
            accept = taken / verified if verified else 1.0
            print(
                f"| {name} | {bs} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {accept:.2f} | "
                f"{'yes' if same[(name, bs)] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
