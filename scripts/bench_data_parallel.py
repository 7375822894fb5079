"""bench_serving through SGLang's router with one replica and with two (--dp-size 2), side by side.

    python scripts/bench_data_parallel.py [--model-path P] [--tokenizer-path P] [--dtype bfloat16] \\
        [--max-total-tokens 16384] [--num-prompts 32] [--input-len 128] [--output-len 64] \\
        [--max-concurrency 16] [--seed 0] [--rounds 2] [--json out.json]

"1 replica": one launch_server with sglang-router in front of it; "2 replicas": `launch_server
--dp-size 2`, the router in front of two replicas that share the cores. The same seeded workload
goes through the router to both (bench_serving's srt backend: /generate with token ids), fresh
servers each run, the order alternating over --rounds (bench_configs.py). Needs sglang-router
(`pip install -e ".[router]"`). On a machine with as many cores as one replica uses, two replicas
cannot be faster: they split the same cores, and each runs its batch with half the threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
for path in (SCRIPTS, SCRIPTS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_serving  # noqa: E402
from bench_clients import HTTP_ERRORS, http_call  # noqa: E402
from bench_configs import (  # noqa: E402
    Run,
    add_common_args,
    check_common_args,
    format_table,
    round_orders,
    summarize,
    warmup,
)

from srt.server_process import ServerProcess  # noqa: E402
from srt.utils import free_port  # noqa: E402

CONFIGS: dict[str, tuple[str, ...]] = {"1 replica": (), "2 replicas": ("--dp-size", "2")}
RATIO_LINE = "throughput of {config}: {ratio} of {baseline}, both through sglang-router"


class Router:
    """sglang-router in front of `worker_url`, until closed."""

    def __init__(self, worker_url: str, timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-urls",
                worker_url,
                "--policy",
                "cache_aware",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if http_call(self.url + "/readiness", timeout_s=2).status == 200:
                    return
            except HTTP_ERRORS:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError("sglang-router did not become ready")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def vocab_size(args: argparse.Namespace) -> int:
    from model_executor.loader.model_path import resolve_model_path
    from model_executor.loader.weight_source import load_hf_config

    return int(load_hf_config(resolve_model_path(args.model_path)).vocab_size)


def measure(
    config: str, flags: tuple[str, ...], round_index: int, args: argparse.Namespace, vocab: int
) -> Run:
    server_args = ["--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens), *flags]
    for flag, value in (("--model-path", args.model_path), ("--tokenizer-path", args.tokenizer_path)):
        if value is not None:
            server_args += [flag, value]
    print(f"--- round {round_index + 1}/{args.rounds}: {config} ---", flush=True)
    with ServerProcess(server_args, args.startup_timeout) as server:
        router = Router(server.url) if not flags else None  # --dp-size 2 starts its own
        url = router.url if router is not None else server.url
        try:
            warmup(url, args.input_len)
            bench_args = bench_serving.parse_args(
                [
                    "--base-url",
                    url,
                    "--backend",
                    "srt",
                    "--vocab-size",
                    str(vocab),
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
        finally:
            if router is not None:
                router.close()
    itl = metrics.itl_ms.mean if metrics.itl_ms is not None else None
    run = Run(config, round_index, metrics.output_throughput, itl, metrics.completed, metrics.failed)
    print(
        f"{config}: {run.output_throughput:.2f} tok/s, mean ITL {itl if itl is None else round(itl, 2)} ms, "
        f"{run.completed} completed, {run.failed} failed",
        flush=True,
    )
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, num_prompts=32, input_len=128, output_len=64, max_concurrency=16)
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = vocab_size(args)
    runs: list[Run] = []
    try:
        for round_index, order in enumerate(round_orders(list(CONFIGS), args.rounds)):
            runs += [measure(config, CONFIGS[config], round_index, args, vocab) for config in order]
    except HTTP_ERRORS + (RuntimeError,) as error:
        print(f"bench_data_parallel: {error}", file=sys.stderr)
        return 1
    rows = summarize(runs, CONFIGS)
    print(format_table(rows, RATIO_LINE), flush=True)
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "results": rows}, indent=2))
    return 0 if all(r.completed > 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
