"""The same serving workload on srt and on Hugging Face transformers, in one run, side by side.

    python scripts/compare_peers.py [--model-path P] [--tokenizer-path P] [--url URL] \\
        [--num-prompts 32] [--input-len 128] [--output-len 64] [--concurrency 32 ...] [--dtype bfloat16] \\
        [--tp-size 1] [--server-args="--max-running-requests 64"] [--peers generate continuous] [--rounds 3] \\
        [--llama-gguf FILE [--llama-server CMD] [--llama-threads N] [--llama-args="..."]] [--json out.json]

Workload: per concurrency level, `--num-prompts` fresh seeded random prompts of exactly `--input-len`
token ids, greedy, EOS ignored so that every request makes exactly `--output-len` tokens; at most
`--concurrency` requests in flight. The prompts of a level are the same for every system.

srt: a server is started (`python -m srt.launch_server` on a free loopback port, then stopped before
the peers run), or `--url` points at a running one (any OpenAI-compatible server works, see
bench_serving.py's --backend); it is measured the way bench_serving.py measures, after one warmup
request. Peers on the same checkpoint and dtype, in this process, warmed up at each level's shape:
`generate` (static batches of `concurrency` prompts, left-padded) and `continuous` (transformers'
own continuous batching, when the installed version has it; `--peers` with no mode runs neither). See
transformers_peer.py for how their requests are timed. With `--llama-gguf`, llama.cpp's server
(llama_peer.py) also serves that file, the same weights converted to GGUF, with one slot per request of
the highest level, and is measured by the same client as srt through `/v1/completions`.

Prints one table per level and one line per metric and peer, e.g.
`ratio vs transformers generate (output tok/s, 32 concurrent): 1.23x`; a ratio above 1 means srt is
better (srt / peer for throughput, peer / srt for latency). Exit status 1 when a request failed.

`--rounds N` measures srt and then the peers N times over, on fresh prompts each round (a running
server's prefix cache cannot serve a later round), and prints each round's tables and ratios, then
each ratio's median over the rounds with the rounds' values: on a shared machine whose speed moves
from minute to minute, a ratio of two figures measured next to each other, taken over several rounds,
says more than one pair of runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
for path in (SCRIPTS, ROOT):  # the sibling bench modules, and this checkout installed or not
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import transformers_peer as peers  # noqa: E402
from bench_clients import BACKENDS, HTTP_ERRORS, http_call, open_session, resolve_target  # noqa: E402
from bench_metrics import BenchMetrics, LevelResult, compute_metrics  # noqa: E402
from bench_serving import Workload, random_prompts, run_level, warmup  # noqa: E402
from llama_peer import LlamaServer, is_llama_server, llama_command  # noqa: E402

from model_executor.loader.model_path import resolve_model_path  # noqa: E402
from model_executor.loader.weight_source import load_hf_config  # noqa: E402
from srt.server_process import ServerProcess  # noqa: E402

PEER_NAMES = {"generate": "transformers generate", "continuous": "transformers continuous batching"}
PEER_WARMUP_TOKENS = 2


def _p(stats_name: str, q: str) -> Callable[[BenchMetrics], float | None]:
    return lambda m: None if getattr(m, stats_name) is None else getattr(getattr(m, stats_name), q)


# (row label, ratio label, value, higher is better)
METRICS: list[tuple[str, str, Callable[[BenchMetrics], float | None], bool]] = [
    ("request throughput (req/s)", "request throughput", lambda m: m.request_throughput, True),
    ("output tok/s", "output tok/s", lambda m: m.output_throughput, True),
    ("TTFT p50 (ms)", "TTFT p50", _p("ttft_ms", "p50"), False),
    ("TTFT p99 (ms)", "TTFT p99", _p("ttft_ms", "p99"), False),
    ("ITL p50 (ms)", "ITL p50", _p("itl_ms", "p50"), False),
    ("ITL p99 (ms)", "ITL p99", _p("itl_ms", "p99"), False),
    ("E2E p50 (ms)", "E2E p50", _p("e2e_ms", "p50"), False),
    ("E2E p99 (ms)", "E2E p99", _p("e2e_ms", "p99"), False),
]


# ---- report: pure functions ----
def ratio(srt: float | None, peer: float | None, higher_is_better: bool) -> float | None:
    """Above 1 when srt is better; None when either figure is missing or zero."""
    if srt is None or peer is None or srt <= 0 or peer <= 0:
        return None
    return srt / peer if higher_is_better else peer / srt


def format_level(concurrency: int, systems: dict[str, LevelResult], description: str) -> str:
    widths = [max(len(name), 10) for name in systems]
    header = f"{'metric':<28}" + "".join(f"  {name:>{w}}" for name, w in zip(systems, widths))
    lines = [f" {concurrency} concurrent: {description} ".center(len(header), "="), header]
    for label, _, value, _ in METRICS:
        cells = [value(level.metrics) for level in systems.values()]
        lines.append(
            f"{label:<28}"
            + "".join(f"  {'n/a' if v is None else f'{v:.2f}':>{w}}" for v, w in zip(cells, widths))
        )
    return "\n".join(lines)


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def ratio_lines(concurrency: int, srt: BenchMetrics, peer_name: str, peer: BenchMetrics) -> list[str]:
    lines = []
    for _, name, value, higher_is_better in METRICS:
        r = ratio(value(srt), value(peer), higher_is_better)
        lines.append(f"ratio vs {peer_name} ({name}, {concurrency} concurrent): {_x(r)}")
    return lines


def round_ratios(pairs: list[tuple[BenchMetrics, BenchMetrics]]) -> dict[str, list[float | None]]:
    """Per metric, the ratio of each round's (srt, peer) figures, in round order."""
    return {
        name: [ratio(value(srt), value(peer), better) for srt, peer in pairs]
        for _, name, value, better in METRICS
    }


def median_ratio(values: list[float | None]) -> float | None:
    """The median of the rounds' ratios; None when a round has none."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(v for v in values if v is not None)


def median_ratio_lines(
    concurrency: int, peer_name: str, pairs: list[tuple[BenchMetrics, BenchMetrics]]
) -> list[str]:
    return [
        f"ratio vs {peer_name} ({name}, {concurrency} concurrent): {_x(median_ratio(values))} "
        f"(median of {len(values)} rounds: {', '.join(_x(v) for v in values)})"
        for name, values in round_ratios(pairs).items()
    ]


# ---- the two sides ----
def make_workloads(args: argparse.Namespace, vocab_size: int, round_index: int = 0) -> dict[int, Workload]:
    rng = random.Random(args.seed + 1_000_003 * round_index)
    n = args.num_prompts
    return {
        c: Workload(random_prompts([args.input_len] * n, vocab_size, rng), [args.output_len] * n, [0.0] * n)
        for c in args.concurrency
    }


def server_args(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--tp-size", str(args.tp_size)]
    if args.model_path is not None:
        flags += ["--model-path", args.model_path]
    if args.tokenizer_path is not None:
        flags += ["--tokenizer-path", args.tokenizer_path]
    return flags + shlex.split(args.server_args)


async def measure_server(
    url: str, args: argparse.Namespace, workloads: dict[int, Workload], name: str = "srt", backend: str = ""
) -> list[LevelResult]:
    async with open_session(60.0) as client:
        target, _ = await resolve_target(client, url, backend or args.backend)
    first_prompt = next(iter(workloads.values())).prompts[0]
    await warmup(target, [first_prompt], args.request_timeout)
    levels = []
    for concurrency, workload in workloads.items():
        print(f"{name} ({target.backend} backend at {target.url}): {concurrency} concurrent", flush=True)
        levels.append(await run_level(target, workload, concurrency, True, args.request_timeout))
    return levels


def run_srt(args: argparse.Namespace, workloads: dict[int, Workload]) -> list[LevelResult]:
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            print(f"starting srt: launch_server {' '.join(server_args(args))}", flush=True)
            url = stack.enter_context(ServerProcess(server_args(args), args.startup_timeout)).url
        return asyncio.run(measure_server(url, args, workloads))


def run_llama(args: argparse.Namespace, workloads: dict[int, Workload]) -> list[LevelResult]:
    """llama.cpp's server on --llama-gguf, one slot per request of the highest level, measured by the
    same client as srt (its /v1/completions takes token-id prompts and ignore_eos)."""
    command = llama_command(args.llama_server)
    parallel = max(args.concurrency) if is_llama_server(command) else 1
    context = args.input_len + args.output_len + 16
    extra = shlex.split(args.llama_args)
    print(f"starting llama.cpp: {' '.join(command)} ({parallel} slots) {' '.join(extra)}", flush=True)
    with LlamaServer(command, args.llama_gguf, args.llama_threads, context, parallel, extra) as llama:
        return asyncio.run(measure_server(llama.url, args, workloads, "llama.cpp", "openai"))


def run_peer(
    model: Any, mode: str, args: argparse.Namespace, workloads: dict[int, Workload]
) -> list[LevelResult]:
    def once(prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list[Any], float]:
        if mode == "generate":
            return peers.run_generate(model, prompts, output_len, concurrency)
        return peers.run_continuous(model, prompts, output_len, concurrency, args.request_timeout)

    levels = []
    for concurrency, workload in workloads.items():
        once(workload.prompts[:concurrency], PEER_WARMUP_TOKENS, concurrency)  # warmup at this batch shape
        print(f"{PEER_NAMES[mode]}: {concurrency} concurrent", flush=True)
        results, duration = once(workload.prompts, args.output_len, concurrency)
        levels.append(LevelResult(concurrency, compute_metrics(results, duration), results))
    return levels


def transformers_model_dir(args: argparse.Namespace) -> Path:
    """--model-path, else the running server's own model directory (srt's /server_info), else the default."""
    if args.model_path is not None or args.url is None:
        return resolve_model_path(args.model_path)
    response = http_call(f"{args.url}/server_info", timeout_s=60)
    info = response.json() if response.status == 200 else {}
    if not isinstance(info, dict) or not info.get("model_dir"):
        raise ValueError(f"{args.url} does not say which model it serves: pass --model-path for transformers")
    return Path(info["model_dir"])


# ---- command line ----
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-path", default=None, help="HF directory or .gguf; default: the bundled SmolLM2"
    )
    parser.add_argument("--tokenizer-path", default=None, help="for the srt server; default: the model's")
    parser.add_argument("--url", default=None, help="measure this running server instead of starting one")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="the server's API, as bench_serving.py's; default: %(default)s",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=32, help="requests per concurrency level; default: %(default)s"
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens; default: %(default)s")
    parser.add_argument(
        "--output-len", type=int, default=64, help="generated tokens per request; default: %(default)s"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[32],
        help="requests in flight, one level each; default: %(default)s",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="of srt and transformers alike; default: %(default)s",
    )
    parser.add_argument(
        "--tp-size", type=int, default=1, help="the srt server's tensor-parallel size; default: %(default)s"
    )
    parser.add_argument(
        "--server-args",
        default="",
        help='more launch_server flags as one string: --server-args="--max-running-requests 64"',
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=peers.MODES,
        default=list(peers.MODES),
        help="transformers modes to run; default: both (continuous is skipped when not installed)",
    )
    parser.add_argument(
        "--llama-gguf",
        default=None,
        help="also serve this GGUF (the same weights) on llama.cpp's server and measure it alike",
    )
    parser.add_argument(
        "--llama-server", default=None, help="llama.cpp server command; default: llama-server on PATH"
    )
    parser.add_argument(
        "--llama-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama.cpp's threads; default: every CPU (%(default)s)",
    )
    parser.add_argument("--llama-args", default="", help="more llama.cpp server flags as one string")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds for the server to start; default: %(default)s",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request; default: %(default)s"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure srt and the peers this many times over, each round on fresh prompts; "
        "ratios are then the median of the rounds' ratios; default: %(default)s",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures and ratios here")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "tp_size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.concurrency) < 1:
        parser.error(f"--concurrency values must be >= 1, got {args.concurrency}")
    if not 0 < args.request_timeout < math.inf or not 0 < args.startup_timeout < math.inf:
        parser.error("--request-timeout and --startup-timeout must be positive numbers of seconds")
    args.concurrency = list(dict.fromkeys(args.concurrency))  # a level once, in the order given
    args.url = args.url.rstrip("/") if args.url else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_dir = transformers_model_dir(args)
        config = load_hf_config(model_dir)
    except HTTP_ERRORS + (ValueError,) as error:
        print(f"compare_peers: {error}", file=sys.stderr)
        return 1
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if context and args.input_len + args.output_len > context:
        print(
            f"compare_peers: --input-len + --output-len ({args.input_len + args.output_len}) exceeds the "
            f"model's context length ({context})",
            file=sys.stderr,
        )
        return 1
    description = (
        f"{args.num_prompts} prompts, {args.input_len} input / {args.output_len} output tokens, "
        f"greedy, {args.dtype}"
    )
    print(f"model {model_dir}; {description}; levels {args.concurrency}; rounds {args.rounds}", flush=True)
    rounds: list[dict[str, list[LevelResult]]] = []
    model = None
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        workloads = make_workloads(args, int(config.vocab_size), r)
        try:
            systems: dict[str, list[LevelResult]] = {"srt": run_srt(args, workloads)}
        except HTTP_ERRORS + (RuntimeError, ValueError) as error:
            print(f"compare_peers: srt: {error}", file=sys.stderr)
            return 1
        if args.llama_gguf is not None:
            try:
                systems["llama.cpp"] = run_llama(args, workloads)
            except (RuntimeError, ValueError) as error:
                print(f"compare_peers: llama.cpp: {error}", file=sys.stderr)
                return 1
        if args.peers and model is None:
            model = peers.load_model(str(model_dir), getattr(torch, args.dtype))
        for mode in args.peers:
            if mode == "continuous" and not peers.has_continuous_batching(model):
                if r == 0:
                    print(
                        "transformers continuous batching is not in this transformers version: skipped",
                        flush=True,
                    )
                continue
            systems[PEER_NAMES[mode]] = run_peer(model, mode, args, workloads)
        rounds.append(systems)
    print(
        f"torch threads {torch.get_num_threads()} for transformers; "
        "ratios above 1 mean srt is better (srt / peer for throughput, peer / srt for latency)"
    )
    print_report(args, rounds, description)
    report = json_report(args, model_dir, rounds)
    failed = {
        name: sum(level.metrics.failed for systems in rounds for level in systems[name]) for name in rounds[0]
    }
    for name, count in failed.items():
        if count:
            errors = [e for systems in rounds for level in systems[name] for e in level.metrics.errors]
            print(f"{name}: {count} request(s) failed, first: {errors[0]}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(failed.values()) else 0


def print_report(
    args: argparse.Namespace, rounds: list[dict[str, list[LevelResult]]], description: str
) -> None:
    """Per level: each round's table and ratio lines; with more than one round, the median lines."""
    for i, concurrency in enumerate(args.concurrency):
        for r, systems in enumerate(rounds):
            at_level = {name: levels[i] for name, levels in systems.items()}
            label = description if len(rounds) == 1 else f"{description}, round {r + 1} of {len(rounds)}"
            print(format_level(concurrency, at_level, label))
            for name, level in at_level.items():
                if name != "srt":
                    lines = ratio_lines(concurrency, at_level["srt"].metrics, name, level.metrics)
                    print(
                        "\n".join(lines if len(rounds) == 1 else [f"round {r + 1}: {line}" for line in lines])
                    )
        if len(rounds) > 1:
            for name in rounds[0]:
                if name != "srt":
                    pairs = [(systems["srt"][i].metrics, systems[name][i].metrics) for systems in rounds]
                    print("\n".join(median_ratio_lines(concurrency, name, pairs)))


def json_report(
    args: argparse.Namespace, model_dir: Path, rounds: list[dict[str, list[LevelResult]]]
) -> dict[str, Any]:
    """Per level: every system's figures in each round (`rounds`; the first round's also at the top, as
    before --rounds), the median ratios (`ratios`) and each round's (`round_ratios`)."""
    report: dict[str, Any] = {
        "model_dir": str(model_dir),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "levels": [],
    }
    peer_names = [name for name in rounds[0] if name != "srt"]
    for i, concurrency in enumerate(args.concurrency):
        per_round = {
            name: round_ratios([(systems["srt"][i].metrics, systems[name][i].metrics) for systems in rounds])
            for name in peer_names
        }
        report["levels"].append(
            {
                "concurrency": concurrency,
                **{name: levels[i].to_json() for name, levels in rounds[0].items()},
                "rounds": [
                    {name: levels[i].to_json() for name, levels in systems.items()} for systems in rounds
                ],
                "ratios": {
                    name: {m: median_ratio(v) for m, v in per_round[name].items()} for name in peer_names
                },
                "round_ratios": per_round,
            }
        )
    return report


if __name__ == "__main__":
    sys.exit(main())
