"""Soak: a server under mixed traffic for N minutes, its processes' resident memory over time.

    python scripts/soak.py --minutes 10 -- --cpu-kvcache-space 0.25

starts `launch_server` with the flags after `--` (none: the default server, bundled SmolLM2 in
bf16) and keeps `--concurrency` clients busy with a mix like a real user's: completions of
random prompts (16-600 token ids, a quarter of them after one of a few shared prefixes),
streams the client drops after a few chunks, and bad requests (a 400 each). Every `--interval`
seconds, and at the start and the end, it prints each process's resident memory (RSS, as the
server's own /server_info reports it) with the KV pages cached and free. It prints the start-up
line that names the KV budget, and `--json-out` keeps every sample.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from srt.server_process import ServerProcess

MB = 1 << 20
VOCAB_RANGE = (100, 49000)  # token ids every model of interest here has (SmolLM2: 49152)


class Traffic:
    """`concurrency` client threads until `stop` is set; counts what happened."""

    def __init__(self, url: str, concurrency: int, seed: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.counts = {
            "completed": 0,
            "dropped_streams": 0,
            "bad_requests": 0,
            "errors": 0,
            "prompt_tokens": 0,
        }
        self.lock = threading.Lock()
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(*VOCAB_RANGE) for _ in range(rng.randint(64, 256))] for _ in range(4)]
        self.threads = [
            threading.Thread(target=self._client, args=(seed * 1000 + i,), daemon=True)
            for i in range(concurrency)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def _prompt(self, rng: random.Random) -> list[int]:
        ids = [rng.randrange(*VOCAB_RANGE) for _ in range(rng.randint(16, 600))]
        if rng.random() < 0.25:
            ids = rng.choice(self.prefixes) + ids
        return ids

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            kind = rng.random()
            try:
                if kind < 0.1:
                    r = requests.post(
                        self.url + "/generate",
                        timeout=60,
                        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": -1}},
                    )
                    self._count("bad_requests" if r.status_code == 400 else "errors")
                elif kind < 0.3:
                    self._dropped_stream(rng)
                else:
                    ids = self._prompt(rng)
                    r = requests.post(
                        self.url + "/generate",
                        timeout=600,
                        json={
                            "input_ids": ids,
                            "sampling_params": {"max_new_tokens": rng.randint(8, 64), "temperature": 0.7},
                        },
                    )
                    if r.status_code == 200:
                        self._count("completed")
                        self._count("prompt_tokens", len(ids))
                    else:
                        self._count("errors")
            except requests.RequestException:
                self._count("errors")

    def _dropped_stream(self, rng: random.Random) -> None:
        ids = self._prompt(rng)
        with requests.post(
            self.url + "/generate",
            stream=True,
            timeout=600,
            json={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 256}},
        ) as r:
            if r.status_code != 200:
                self._count("errors")
                return
            chunks = 0
            for line in r.iter_lines():
                chunks += bool(line)
                if chunks >= 3:
                    break  # the client goes away mid-stream
        self._count("dropped_streams")
        self._count("prompt_tokens", len(ids))


def sample(url: str, t0: float) -> dict[str, Any]:
    info = requests.get(url + "/server_info", timeout=60).json()
    state = info["internal_states"][0]
    return {
        "t_s": round(time.monotonic() - t0),
        "rss": {p["name"]: p["rss_bytes"] for p in info["memory"]["processes"]},
        "cached_pages": state["cached_pages"],
        "free_pages": state["free_pages"],
        "num_pages": state["num_pages"],
        "available_bytes": info["memory"]["host_available_bytes"],
    }


def print_sample(s: dict[str, Any], header: bool) -> None:
    names = list(s["rss"])
    if header:
        print("t (s)  " + "  ".join(f"{n + ' MB':>16}" for n in names) + "  cached/free KV pages", flush=True)
    print(
        f"{s['t_s']:>5}  "
        + "  ".join(f"{s['rss'][n] / MB:>16.0f}" for n in names)
        + f"  {s['cached_pages']}/{s['free_pages']}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("server_args", nargs="*", help="launch_server flags (after --)")
    args = parser.parse_args()
    if args.minutes <= 0 or args.interval <= 0 or args.concurrency < 1:
        parser.error("--minutes and --interval must be positive, --concurrency at least 1")
    with ServerProcess(args.server_args, args.startup_timeout) as server:
        log = server.output()
        budget = [ln for ln in log.splitlines() if "KV cache budget" in ln]
        print(budget[-1].split("] ", 1)[-1] if budget else "(no KV budget line in the log)", flush=True)
        t0 = time.monotonic()
        samples = [sample(server.url, t0)]
        print_sample(samples[0], header=True)
        traffic = Traffic(server.url, args.concurrency, args.seed)
        traffic.start()
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(
                max(0.0, min(args.interval - (time.monotonic() - t0) % args.interval, end - time.monotonic()))
            )
            samples.append(sample(server.url, t0))
            print_sample(samples[-1], header=False)
        traffic.finish()
        samples.append(sample(server.url, t0))
        print_sample(samples[-1], header=False)
        print("traffic:", json.dumps(traffic.counts), flush=True)
        if args.json_out is not None:
            args.json_out.write_text(
                json.dumps(
                    {
                        "server_args": args.server_args,
                        "budget_line": budget[-1:],
                        "counts": traffic.counts,
                        "samples": samples,
                    },
                    indent=1,
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
