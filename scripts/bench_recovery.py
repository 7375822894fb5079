"""Recovery time after a lost rank: from the SIGKILL to the first token each stream gets after it.

    python scripts/bench_recovery.py [--model-path P] [--tokenizer-path P] [--tp 1] [--dtype auto] \\
        [--streams 8] [--output-len 256] [--kills 1] [--json out.json] [-- extra launch_server flags]

Starts a server with --restart-on-failure, opens --streams greedy streams, and once every stream
has its first tokens SIGKILLs the scheduler of the last TP rank. Per stream it records the time
from the kill to its next token (the restarted engine's replay), and that every stream ended
normally; --kills repeats the kill on the restarted engine. Prints one line per kill (min /
median / max over the streams) and the server's own "engine restarted in" figure. Exit status 1
when the server does not start, or a stream fails or does not resume.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench this checkout, installed or not

from srt.utils import free_port  # noqa: E402


class StreamClock(threading.Thread):
    """One stream; token_times[i] is when output token i arrived (time.monotonic)."""

    def __init__(self, url: str, prompt: list[int], output_len: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.output_len = url, prompt, output_len
        self.token_times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        body: dict[str, Any] = {
            "input_ids": self.prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": self.output_len, "temperature": 0, "ignore_eos": True},
        }
        try:
            with requests.post(self.url + "/generate", json=body, stream=True, timeout=600) as r:
                for line in r.iter_lines(decode_unicode=True):
                    if not line or line == "data: [DONE]":
                        continue
                    out = json.loads(line[6:])
                    if "error" in out:
                        self.error = str(out["error"])
                        return
                    now = time.monotonic()
                    self.token_times += [now] * (len(out["output_ids"]) - len(self.token_times))
        except requests.RequestException as error:
            self.error = repr(error)
        if self.error is None and len(self.token_times) != self.output_len:
            self.error = f"ended after {len(self.token_times)} of {self.output_len} tokens"


def start_server(args: argparse.Namespace, log: Any) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "srt.launch_server",
        "--port",
        str(port),
        "--tp",
        str(args.tp),
        "--dtype",
        args.dtype,
        "--restart-on-failure",
        str(args.kills),
        *args.extra,
    ]
    for flag, value in (("--model-path", args.model_path), ("--tokenizer-path", args.tokenizer_path)):
        if value:
            cmd += [flag, value]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not start")


def victim_pid(proc: subprocess.Popen[bytes], title: str) -> int:
    for child in psutil.Process(proc.pid).children(recursive=True):
        if " ".join(child.cmdline()).strip() == title:
            return child.pid
    raise RuntimeError(f"no process titled {title}")


def recovery_began(url: str, timeout: float = 60.0) -> float:
    """When /health turned 503 (the front end began the recovery, before the old engine is torn down)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if requests.get(url + "/health", timeout=5).status_code == 503:
            return time.monotonic()
        time.sleep(0.005)
    raise RuntimeError(f"/health did not turn 503 within {timeout} s of the kill")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path")
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("extra", nargs="*", help="more launch_server flags (after --)")
    args = parser.parse_args()
    title = f"srt::scheduler_TP{args.tp - 1}"
    rows: list[dict[str, Any]] = []
    with tempfile.NamedTemporaryFile("w+b", prefix="bench-recovery-", suffix=".log", delete=False) as log:
        try:
            proc, url = start_server(args, log)
        except RuntimeError as error:
            print(f"bench_recovery: {error}; log in {log.name}", file=sys.stderr)
            return 1
        try:
            streams = [
                StreamClock(url, list(range(5 + i, 40 + i)), args.output_len) for i in range(args.streams)
            ]
            for s in streams:
                s.start()
            for kill in range(1, args.kills + 1):
                counts = [len(s.token_times) for s in streams]
                while any(len(s.token_times) <= c + 1 for s, c in zip(streams, counts)):
                    time.sleep(0.01)  # every stream is under way (again)
                killed = time.monotonic()
                os.kill(victim_pid(proc, title), signal.SIGKILL)
                began = recovery_began(url)  # tokens after this come from the restarted engine
                while any(s.is_alive() and not any(t > began for t in s.token_times) for s in streams):
                    time.sleep(0.01)
                resumed = [
                    next(t for t in s.token_times if t > began) - killed
                    for s in streams
                    if any(t > began for t in s.token_times)
                ]
                if len(resumed) < len(streams):
                    print(f"bench_recovery: a stream did not resume after kill {kill}", file=sys.stderr)
                    return 1
                rows.append(
                    {
                        "kill": kill,
                        "min_s": min(resumed),
                        "median_s": statistics.median(resumed),
                        "max_s": max(resumed),
                    }
                )
            for s in streams:
                s.join(600)
            failed = [s.error for s in streams if s.error is not None]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        log.seek(0)
        server_times = re.findall(rb"engine restarted in ([0-9.]+) s", log.read())
    for row, server_s in zip(rows, server_times):
        row["server_restart_s"] = float(server_s)
        print(
            f"kill {row['kill']}: first resumed token after {row['min_s']:.2f} s (min) / {row['median_s']:.2f} s "
            f"(median) / {row['max_s']:.2f} s (max) over {args.streams} streams; server: engine restarted in "
            f"{row['server_restart_s']:.1f} s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if failed:
        print(f"bench_recovery: {len(failed)} stream(s) failed: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
