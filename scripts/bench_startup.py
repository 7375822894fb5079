"""Start-up time and memory of a server: `--starts` launches of `launch_server` with the given flags,
one after another, each until `/health` answers 200 (or the process exits, or `--timeout` passes),
with the resident memory of every process of its tree sampled every 0.1 s until then and for
`--settle` seconds after (its peak, and its value then). Prints one row a start and a summary.

    python scripts/bench_startup.py --starts 10 -- --model-path FILE.gguf --quantization gguf

With `--llama-gguf FILE`, llama.cpp's server (llama_peer.py) starts on that file as often, each start
after one of srt's, timed and sampled alike, one slot of --llama-context tokens (srt's own KV
budget is what its flags make it). Run it with a warm cache (a GGUF file converted once before) to
time what every later start costs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
import requests

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from llama_peer import llama_command  # noqa: E402

from srt.utils import free_port  # noqa: E402


@dataclass
class Start:
    ready_s: float | None  # None: never became ready
    peak_rss: int  # bytes, every process of the tree together
    exit_code: int | None
    ready_rss: int = 0  # the same, `settle` seconds after ready


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def one_start(flags: list[str], timeout: float, settle: float) -> Start:
    """One start of srt's server with `flags`."""
    port = free_port()
    return timed_start(
        [sys.executable, "-m", "srt.launch_server", "--port", str(port), *flags], port, timeout, settle
    )


def timed_start(cmd: list[str], port: int, timeout: float, settle: float) -> Start:
    """One start of the server `cmd` runs, ready when its /health on `port` answers 200."""
    began = time.monotonic()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(server.pid)
    peak, ready = 0, None
    try:
        while time.monotonic() - began < timeout and server.poll() is None:
            peak = max(peak, tree_rss(root))
            if ready is None:
                try:
                    if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        ready = time.monotonic() - began
                except requests.RequestException:
                    pass
            elif time.monotonic() - began > ready + settle:
                return Start(ready, peak, server.poll(), tree_rss(root))
            time.sleep(0.1)
        return Start(ready, peak, server.poll())
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def summary(starts: list[Start], who: str = "srt") -> str:
    ready = [s.ready_s for s in starts if s.ready_s is not None]
    lines = [
        who,
        f"{'start':>5} | {'ready (s)':>9} | {'peak RSS, all processes (MB)':>28} | {'RSS when ready (MB)':>19}",
    ]
    for i, s in enumerate(starts, 1):
        shown = f"{s.ready_s:.1f}" if s.ready_s is not None else f"failed ({s.exit_code})"
        lines.append(f"{i:>5} | {shown:>9} | {s.peak_rss / 2**20:>28.0f} | {s.ready_rss / 2**20:>19.0f}")
    median = f"median ready {statistics.median(ready):.1f} s" if ready else "none ready"
    lines.append(
        f"{len(ready)} of {len(starts)} starts ready; {median}; "
        f"peak RSS {max(s.peak_rss for s in starts) / 2**20:.0f} MB"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds sampled after ready")
    parser.add_argument("--llama-gguf", default=None, help="also start llama.cpp's server on this file")
    parser.add_argument(
        "--llama-server", default=None, help="llama.cpp server command; default: llama-server"
    )
    parser.add_argument("--llama-threads", type=int, default=psutil.cpu_count() or 1)
    parser.add_argument("--llama-context", type=int, default=4096, help="llama.cpp's context (one slot)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="launch_server's flags, after --")
    args = parser.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    srt, llama = [], []
    for _ in range(args.starts):  # alternating: each side meets the machine as the other left it
        srt.append(one_start(flags, args.timeout, args.settle))
        if args.llama_gguf is not None:
            port = free_port()
            command = llama_command(args.llama_server) + [
                *("-m", args.llama_gguf, "--host", "127.0.0.1", "--port", str(port)),
                *("-t", str(args.llama_threads), "-c", str(args.llama_context), "-np", "1"),
            ]
            llama.append(timed_start(command, port, args.timeout, args.settle))
    print(summary(srt))
    if llama:
        print(summary(llama, "llama.cpp"))


if __name__ == "__main__":
    main()
