"""Soak: a server under mixed traffic for N minutes: errors by kind, latency over time, each process's
resident memory, and the KV cache's integrity at the end.

    python scripts/soak.py --minutes 10 -- --cpu-kvcache-space 0.25
    python scripts/soak.py --minutes 10 --min-prompt-tokens 16 --max-prompt-tokens 4000 \
        --rss-margin-mb 256 -- --cpu-kvcache-space 0.25
    python scripts/soak.py --minutes 10 --url http://127.0.0.1:30000

The first starts `launch_server` with the flags after `--` (none: the default server, bundled
SmolLM2 in bf16); the second soaks a server already running (its key in --api-key or SRT_API_KEY).
`--concurrency` clients each pick, request after request, one of the traffic kinds (KINDS):
/generate completions and streams read to their end, /v1/completions (half of them streamed),
streams the client drops after a few chunks, streams ended by /abort_request, and bad requests of
several sorts (each must be a 400 naming the bad parameter). Prompts are random token ids, short,
medium or long (up to the context length or the KV cache, whichever is smaller, less the new tokens;
`--min-prompt-tokens` / `--max-prompt-tokens` narrow that), a quarter of them after one of a few
shared prefixes. Every answer is checked (a well-formed body or stream, `data: [DONE]` at its end, a
finish reason that fits the request) and counted by outcome (soak_report.py).

Every `--interval` seconds it prints a row: the requests that ended in the interval, how many were
unexpected, their p50 / p99 end-to-end latency and time to first token, the KV pages cached and
free, and each process's RSS (as the server's /server_info reports it). After the traffic it waits
for the server to go idle and checks the KV cache: the server's own integrity check, every page free
or cached, and after /flush_cache (`--no-flush`: not) every page free; a process replaced or an
engine restart (from /metrics, where on) fails the soak too. Then it prints each process's RSS at
the start and the end, each process's growth over the run's last half with its bound, the outcomes
by traffic kind, and `KV integrity: ok` or what failed. With `--rss-margin-mb MB` memory is judged
too (`memory: PASS` or what failed): every process must grow at most `--rss-flat-pct` % over the
last half and stay under its RSS at the start plus, for a rank, the KV cache, plus MB. The exit
status is 1 on any unexpected outcome or failed check. `--json-out` keeps everything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

SCRIPTS = Path(__file__).resolve().parent
for path in (SCRIPTS, SCRIPTS.parent):  # this checkout's srt, not an installed one
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import soak_report as report  # noqa: E402
from soak_report import Record  # noqa: E402

from srt.server_process import ServerProcess  # noqa: E402

KINDS = ["generate", "stream", "openai", "dropped", "abort", "bad"]
WEIGHTS = [0.3, 0.2, 0.1, 0.15, 0.1, 0.15]
PREFIX_SHARE = 0.25  # prompts after one of the shared prefixes
SHAPES = {"short": 0.35, "medium": 0.6, "long": 0.05}  # prompt lengths: 1-32, 16-600, near the limit
LONG_STREAM_TOKENS = 256  # new tokens asked for by streams that are dropped or aborted midway


@dataclass(frozen=True)
class Target:
    """The server soaked, as /server_info and /v1/models describe it."""

    url: str
    headers: dict[str, str]  # the API key's, on every request
    admin_headers: dict[str, str]  # /flush_cache's
    vocab_size: int
    limit: int  # prompt + new tokens of one request: the context length or the KV cache, the smaller
    incremental: bool  # --incremental-streaming-output: a stream's chunks carry only their new ids
    model: str  # the name /v1/completions takes


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


class Prompts:
    """Random token ids inside the vocabulary (above the low ids, where special tokens sit), each
    prompt `min_tokens` to `max_tokens` long (None: as long as the limit allows)."""

    def __init__(
        self,
        vocab_size: int,
        limit: int,
        rng: random.Random,
        min_tokens: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        self.low, self.high = min(100, vocab_size // 2), vocab_size
        self.limit = limit
        self.min_tokens = min_tokens
        self.max_tokens = limit if max_tokens is None else min(max_tokens, limit)
        self.prefixes = [self._ids(rng, min(rng.randint(64, 256), self.max_tokens // 4)) for _ in range(4)]

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.low, self.high) for _ in range(max(n, 1))]

    def make(self, rng: random.Random, max_new: int) -> tuple[list[int], str, int]:
        """(ids, shape, max_new capped) with len(ids) + max_new <= limit and len(ids) within
        [min_tokens, max_tokens] where the limit leaves room for min_tokens."""
        max_new = min(max_new, self.limit // 2)
        room = min(self.limit - max_new, self.max_tokens)
        lo = min(self.min_tokens, room)
        shape = rng.choices(list(SHAPES), list(SHAPES.values()))[0]
        if shape == "short":
            n = rng.randint(lo, max(lo, 32))
        elif shape == "medium":
            n = rng.randint(max(16, lo), max(16, lo, min(600, room // 2)))
        else:
            n = rng.randint(room * 9 // 10, room)
        ids = self._ids(rng, min(max(n, lo), room))
        if rng.random() < PREFIX_SHARE:
            ids = rng.choice(self.prefixes) + ids
            shape += "+prefix"
        return ids[:room], shape, max_new


@dataclass
class Call:
    """One request in flight: what its record needs besides the outcome."""

    kind: str
    sent: float  # time.monotonic()
    prompt: str = ""
    first_token: float | None = None


class Traffic:
    """`concurrency` client threads until `finish`; one Record per request."""

    def __init__(
        self, target: Target, concurrency: int, seed: int, request_timeout: float, prompts: Prompts
    ) -> None:
        self.target = target
        self.timeout = request_timeout
        self.stop = threading.Event()
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.prompts = prompts
        self.bad = bad_requests(target)
        self.threads = [
            threading.Thread(target=self._client, args=(seed * 1000 + i,), daemon=True)
            for i in range(concurrency)
        ]

    def start(self) -> None:
        self.t0 = time.monotonic()
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=self.timeout + 30)

    def snapshot(self) -> list[Record]:
        with self.lock:
            return list(self.records)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            call = Call(rng.choices(KINDS, WEIGHTS)[0], time.monotonic())
            try:
                outcome, detail = getattr(self, "_" + call.kind)(rng, call)
            except requests.Timeout as error:
                outcome, detail = report.TIMEOUT, str(error)[:200]
            except report.MalformedStream as error:
                outcome, detail = report.MALFORMED_STREAM, str(error)
            except requests.RequestException as error:  # a read timeout mid-stream comes as ConnectionError
                timed_out = "timed out" in str(error).lower()
                outcome, detail = (report.TIMEOUT if timed_out else report.CONNECTION), str(error)[:200]
            now = time.monotonic()
            record = Record(
                call.kind,
                outcome,
                now - self.t0,
                e2e_s=now - call.sent if outcome == report.OK else None,
                ttft_s=call.first_token - call.sent if call.first_token is not None else None,
                prompt=call.prompt,
                detail=detail,
            )
            with self.lock:
                self.records.append(record)

    def _post(self, path: str, body: Any, stream: bool = False) -> requests.Response:
        return requests.post(
            self.target.url + path,
            json=body,
            headers=self.target.headers,
            timeout=self.timeout,
            stream=stream,
        )

    def _prompt(self, rng: random.Random, call: Call, max_new: int) -> tuple[list[int], int]:
        ids, call.prompt, max_new = self.prompts.make(rng, max_new)
        return ids, max_new

    # ---- the traffic kinds: each returns (outcome, detail) ----
    def _generate(self, rng: random.Random, call: Call) -> tuple[str, str]:
        ids, max_new = self._prompt(rng, call, rng.randint(1, 64))
        sampling = {"max_new_tokens": max_new, "temperature": rng.choice([0.0, 0.7])}
        r = self._post("/generate", {"input_ids": ids, "sampling_params": sampling})
        if r.status_code != 200:
            return report.http_failure(r.status_code), r.text[:200]
        try:
            out = r.json()
            n_ids = len(out["output_ids"])
        except (ValueError, KeyError, TypeError):
            return report.MALFORMED_RESPONSE, r.text[:200]
        return report.judge_generate(out, max_new, n_ids)

    def _stream(self, rng: random.Random, call: Call) -> tuple[str, str]:
        ids, max_new = self._prompt(rng, call, rng.randint(8, 64))
        return self._generate_stream(call, ids, max_new, rng.choice([0.0, 0.7]))

    def _dropped(self, rng: random.Random, call: Call) -> tuple[str, str]:
        ids, max_new = self._prompt(rng, call, LONG_STREAM_TOKENS)
        return self._generate_stream(call, ids, max_new, 0.7, drop_after=rng.randint(1, 3))

    def _abort(self, rng: random.Random, call: Call) -> tuple[str, str]:
        ids, max_new = self._prompt(rng, call, LONG_STREAM_TOKENS)
        return self._generate_stream(call, ids, max_new, 0.7, abort_rid=f"soak-{uuid.uuid4().hex}")

    def _generate_stream(
        self,
        call: Call,
        ids: list[int],
        max_new: int,
        temperature: float,
        drop_after: int | None = None,
        abort_rid: str | None = None,
    ) -> tuple[str, str]:
        """A /generate stream read to its end, or dropped after `drop_after` chunks with tokens, or
        aborted by /abort_request for `abort_rid` after its first chunk with tokens."""
        body: dict[str, Any] = {
            "input_ids": ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": temperature},
        }
        if abort_rid is not None:
            body["rid"] = abort_rid
        with self._post("/generate", body, stream=True) as r:
            if r.status_code != 200:
                return report.http_failure(r.status_code), r.text[:200]
            n_ids, chunks, last, done, abort_sent = 0, 0, None, False, False
            for event in report.sse_events(report.lines_of(r.iter_content(chunk_size=None))):
                if event is report.DONE:
                    done = True
                    continue
                failure = report.stream_error(event)
                if failure is not None:
                    return failure
                if last is not None and last["meta_info"]["finish_reason"] is not None:
                    return report.MALFORMED_STREAM, "a chunk after the one with the finish reason"
                if not isinstance(event, dict) or not isinstance(event.get("output_ids"), list):
                    return report.MALFORMED_STREAM, f"a chunk without output_ids: {str(event)[:200]}"
                if not isinstance(event.get("meta_info"), dict) or "finish_reason" not in event["meta_info"]:
                    return report.MALFORMED_STREAM, f"a chunk without meta_info: {str(event)[:200]}"
                new = (
                    len(event["output_ids"]) if self.target.incremental else len(event["output_ids"]) - n_ids
                )
                n_ids += new
                last = event
                if new > 0:
                    chunks += 1
                    if call.first_token is None:
                        call.first_token = time.monotonic()
                    if drop_after is not None and chunks >= drop_after:
                        return report.DROPPED, ""  # leaving the with block closes the connection
                    if abort_rid is not None and not abort_sent:
                        answer = self._post("/abort_request", {"rid": abort_rid})
                        if answer.status_code != 200:
                            return report.http_failure(
                                answer.status_code
                            ), f"/abort_request: {answer.text[:200]}"
                        abort_sent = True
        if not done:
            return report.MALFORMED_STREAM, "the stream ended without data: [DONE]"
        if last is None:
            return report.MALFORMED_STREAM, "a stream without chunks"
        return report.judge_generate(last, max_new, n_ids, abort_sent)

    def _openai(self, rng: random.Random, call: Call) -> tuple[str, str]:
        ids, max_tokens = self._prompt(rng, call, rng.randint(1, 32))
        body: dict[str, Any] = {
            "model": self.target.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": rng.choice([0.0, 0.7]),
        }
        if rng.random() < 0.5:
            r = self._post("/v1/completions", body)
            if r.status_code != 200:
                return report.http_failure(r.status_code), r.text[:200]
            try:
                out = r.json()
                finish, usage = out["choices"][0]["finish_reason"], out["usage"]
            except (ValueError, KeyError, IndexError, TypeError):
                return report.MALFORMED_RESPONSE, r.text[:200]
            return report.judge_completion(finish, usage, max_tokens)
        body.update(stream=True, stream_options={"include_usage": True})
        with self._post("/v1/completions", body, stream=True) as r:
            if r.status_code != 200:
                return report.http_failure(r.status_code), r.text[:200]
            finish, usage, done = None, None, False
            for event in report.sse_events(report.lines_of(r.iter_content(chunk_size=None))):
                if event is report.DONE:
                    done = True
                    continue
                failure = report.stream_error(event)
                if failure is not None:
                    return failure
                if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
                    return report.MALFORMED_STREAM, f"a chunk without choices: {str(event)[:200]}"
                if event["choices"]:
                    if finish is not None:
                        return report.MALFORMED_STREAM, "a choice after the one with the finish reason"
                    if call.first_token is None:
                        call.first_token = time.monotonic()
                    finish = event["choices"][0].get("finish_reason")
                usage = event.get("usage") or usage
        if not done:
            return report.MALFORMED_STREAM, "the stream ended without data: [DONE]"
        return report.judge_completion(finish, usage, max_tokens)

    def _bad(self, rng: random.Random, call: Call) -> tuple[str, str]:
        name, path, body, param = rng.choice(self.bad)
        if isinstance(body, bytes):
            headers = {**self.target.headers, "Content-Type": "application/json"}
            r = requests.post(self.target.url + path, data=body, headers=headers, timeout=self.timeout)
        else:
            r = self._post(path, body)
        try:
            answer = r.json()
        except ValueError:
            answer = r.text
        outcome, detail = report.judge_refusal(r.status_code, answer, param)
        return outcome, f"{name}: {detail}" if detail else ""


def bad_requests(target: Target) -> list[tuple[str, str, Any, str | None]]:
    """(what is wrong, route, body, the parameter the 400 must name): bytes are sent as they are."""
    ids = [min(100, target.vocab_size // 2)] * 4
    return [
        (
            "negative max_new_tokens",
            "/generate",
            {"input_ids": ids, "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens",
        ),
        (
            "negative temperature",
            "/generate",
            {"input_ids": ids, "sampling_params": {"temperature": -0.5}},
            "temperature",
        ),
        ("top_p above 1", "/generate", {"input_ids": ids, "sampling_params": {"top_p": 2}}, "top_p"),
        ("id past the vocabulary", "/generate", {"input_ids": [target.vocab_size]}, "input_ids"),
        (
            "past the context or KV cache",
            "/generate",
            {"input_ids": ids, "sampling_params": {"max_new_tokens": target.limit}},
            "max_new_tokens",
        ),
        ("no prompt", "/generate", {"sampling_params": {"max_new_tokens": 4}}, "text"),
        ("stream not a boolean", "/generate", {"input_ids": ids, "stream": "yes"}, "stream"),
        ("body not JSON", "/generate", b'{"input_ids": [1, 2', None),
        ("rid not a string", "/abort_request", {"rid": 5}, "rid"),
        (
            "negative max_tokens",
            "/v1/completions",
            {"model": target.model, "prompt": ids, "max_tokens": -1},
            "max_tokens",
        ),
    ]


# ---- the server's state ----
def server_info(url: str, headers: dict[str, str]) -> dict[str, Any]:
    r = requests.get(url + "/server_info", headers=headers, timeout=60)
    r.raise_for_status()
    info: dict[str, Any] = r.json()
    return info


def sample(url: str, headers: dict[str, str], t0: float) -> dict[str, Any]:
    info = server_info(url, headers)
    state = info["internal_states"][0]
    return {
        "t_s": time.monotonic() - t0,
        "processes": {
            p["name"]: {"pid": p["pid"], "rss_bytes": p["rss_bytes"]} for p in info["memory"]["processes"]
        },
        "cached_pages": state["cached_pages"],
        "free_pages": state["free_pages"],
        "used_pages": state["used_pages"],
        "num_pages": state["num_pages"],
        "available_bytes": info["memory"]["host_available_bytes"],
    }


def engine_restarts(url: str, headers: dict[str, str]) -> float | None:
    """srt:engine_restarts_total from /metrics; None without --enable-metrics."""
    r = requests.get(url + "/metrics", headers=headers, timeout=60)
    return report.metric_total(r.text, "srt:engine_restarts_total") if r.status_code == 200 else None


def wait_idle(url: str, headers: dict[str, str], timeout: float) -> dict[str, Any]:
    """The internal state once nothing runs or waits (or, past `timeout`, the last one seen)."""
    deadline = time.monotonic() + timeout
    while True:
        state: dict[str, Any] = server_info(url, headers)["internal_states"][0]
        if not report.busy(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def flush(
    url: str, admin_headers: dict[str, str], headers: dict[str, str], timeout: float
) -> tuple[dict[str, Any] | None, str]:
    """The internal state after /flush_cache, or (None, why it was refused). The server refuses
    while requests are in flight: another client's, when soaking a shared server; retried."""
    deadline = time.monotonic() + timeout
    while True:
        r = requests.post(url + "/flush_cache", headers=admin_headers, timeout=60)
        if r.status_code == 200:
            return server_info(url, headers)["internal_states"][0], ""
        if time.monotonic() > deadline:
            return None, f"/flush_cache answered {r.status_code}: {r.text[:200]}"
        time.sleep(0.5)


def check_end(url: str, target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """After the traffic: the idle state, the flushed one, and what is wrong with the KV cache."""
    idle = wait_idle(url, target.headers, args.idle_timeout)
    flushed, refused = (None, "") if args.no_flush else flush(url, target.admin_headers, target.headers, 30.0)
    problems = report.kv_problems(idle, flushed) + ([refused] if refused else [])
    return {"idle_state": idle, "flushed_state": flushed, "kv_problems": problems}


# ---- the soak ----
def describe(
    url: str, headers: dict[str, str], admin_headers: dict[str, str]
) -> tuple[Target, dict[str, Any]]:
    info = server_info(url, headers)
    state = info["internal_states"][0]
    limits = [
        v
        for v in (info.get("context_length"), info.get("max_total_tokens"), state.get("max_total_tokens"))
        if v
    ]
    models = requests.get(url + "/v1/models", headers=headers, timeout=60).json()["data"]
    target = Target(
        url=url,
        headers=headers,
        admin_headers=admin_headers,
        vocab_size=int(info["vocab_size"]),
        limit=int(min(limits)),
        incremental=bool(info.get("incremental_streaming_output")),
        model=str(models[0]["id"]),
    )
    return target, info


def soak(url: str, args: argparse.Namespace, budget_line: str | None) -> int:
    headers = bearer(args.api_key)
    target, info = describe(url, headers, bearer(args.admin_api_key or args.api_key))
    expected = report.expected_outcomes(info)
    kv_bytes = int(info["internal_states"][0].get("kv_cache_bytes") or 0)
    prompts = Prompts(
        target.vocab_size,
        target.limit,
        random.Random(args.seed),
        args.min_prompt_tokens,
        args.max_prompt_tokens,
    )
    print(budget_line or "(no KV budget line: the server's log is not ours)", flush=True)
    print(
        f"prompts up to {target.limit} tokens with their new tokens (context {info.get('context_length')}, "
        f"KV cache {info.get('max_total_tokens')} tokens), each prompt {prompts.min_tokens} to "
        f"{prompts.max_tokens} tokens; vocabulary {target.vocab_size}; "
        f"{args.concurrency} clients for {args.minutes:g} min",
        flush=True,
    )
    restarts_before = engine_restarts(url, headers)
    traffic = Traffic(target, args.concurrency, args.seed, args.request_timeout, prompts)
    samples = [sample(url, headers, time.monotonic())]
    samples[0]["t_s"] = 0.0
    names = list(samples[0]["processes"])
    rows = [report.interval_row([], -1.0, 0.0, expected)]
    print("\nOver time (each row: the requests that ended since the row before):", flush=True)
    print(report.over_time_header(samples[0]), flush=True)
    print(report.over_time_row(rows[0], samples[0], names), flush=True)

    def add_row() -> None:
        try:
            samples.append(sample(url, headers, traffic.t0))
        except requests.RequestException as error:  # the server is gone: the traffic's records say so
            print(f"  /server_info failed: {error}", flush=True)
            return
        rows.append(report.interval_row(traffic.snapshot(), rows[-1]["t_s"], samples[-1]["t_s"], expected))
        print(report.over_time_row(rows[-1], samples[-1], names), flush=True)

    traffic.start()
    end = traffic.t0 + args.minutes * 60
    while time.monotonic() < end:
        elapsed = time.monotonic() - traffic.t0
        time.sleep(max(0.0, min(args.interval - elapsed % args.interval, end - time.monotonic())))
        add_row()
    traffic.finish()
    add_row()  # the requests that ended after the last interval

    records = traffic.snapshot()
    try:
        end_check = check_end(url, target, args)
        restarts_after = engine_restarts(url, headers)
    except requests.RequestException as error:
        end_check = {
            "idle_state": None,
            "flushed_state": None,
            "kv_problems": [f"the server is unreachable: {error}"],
        }
        restarts_after = None
    processes = report.process_problems(samples[0], samples[-1])
    if restarts_before is not None and restarts_after is not None and restarts_after > restarts_before:
        processes.append(f"{restarts_after - restarts_before:g} engine restarts (srt:engine_restarts_total)")

    print("\nRSS at the start and the end (MB = 2^20 bytes):")
    print(report.rss_table(samples[0], samples[-1]))
    margin = None if args.rss_margin_mb is None else args.rss_margin_mb * report.MB
    memory = report.rss_verdict(samples, kv_bytes, margin, args.rss_flat_pct)
    print(
        f"\nRSS over the last half, from t = {memory['half_t_s']:.0f} s (flat: growing at most "
        f"{args.rss_flat_pct:g}% from the half-way sample; bound: the start, plus the KV cache "
        f"({kv_bytes / report.MB:.0f} MB) for a rank, plus --rss-margin-mb):"
    )
    print(report.rss_verdict_table(memory))
    print("\nOutcomes by traffic kind:")
    print(report.outcome_table(records, KINDS, expected))
    shapes = Counter(r.prompt for r in records if r.prompt)
    print("prompts: " + ", ".join(f"{shape} {n}" for shape, n in sorted(shapes.items())))
    checker = "on" if info.get("enable_rank_consensus_checker") else "off"
    restarts = "n/a (no /metrics)" if restarts_after is None else f"{restarts_after:g}"
    print(f"rank consensus checker: {checker}; engine restarts: {restarts}")
    print("processes: " + ("ok" if not processes else "FAILED: " + "; ".join(processes)))
    kv = end_check["kv_problems"]
    print("KV integrity: " + ("ok" if not kv else "FAILED: " + "; ".join(kv)))
    if margin is None:
        print("memory: not judged (no --rss-margin-mb)", flush=True)
    else:
        print(
            "memory: " + ("PASS" if not memory["problems"] else "FAIL: " + "; ".join(memory["problems"])),
            flush=True,
        )
    unexpected = sum(r.outcome not in expected for r in records)
    if args.json_out is not None:
        args.json_out.write_text(
            json.dumps(
                {
                    "server_args": args.server_args,
                    "url": None if args.url is None else url,
                    "budget_line": budget_line,
                    "limit": target.limit,
                    "kinds": KINDS,
                    "expected_outcomes": sorted(expected),
                    "outcomes": report.outcome_counts(records),
                    "prompt_shapes": dict(shapes),
                    "unexpected": unexpected,
                    "intervals": rows,
                    "samples": samples,
                    "process_problems": processes,
                    "kv_cache_bytes": kv_bytes,
                    "memory": memory,
                    "engine_restarts": restarts_after,
                    "rank_consensus_checker": checker == "on",
                    **end_check,
                    "records": [asdict(r) for r in records],
                },
                indent=1,
            )
        )
    memory_failed = margin is not None and bool(memory["problems"])
    return 1 if unexpected or kv or processes or memory_failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="soak this running server instead of starting one")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between rows")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds, per request")
    parser.add_argument(
        "--idle-timeout", type=float, default=120.0, help="seconds to wait for idle at the end"
    )
    parser.add_argument("--no-flush", action="store_true", help="check the KV cache without /flush_cache")
    parser.add_argument("--api-key", default=os.environ.get("SRT_API_KEY"), help="default: SRT_API_KEY")
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("SRT_ADMIN_API_KEY"),
        help="for /flush_cache; default: SRT_ADMIN_API_KEY",
    )
    parser.add_argument("--min-prompt-tokens", type=int, default=1, help="the shortest prompt")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="the longest prompt (default: the limit)"
    )
    parser.add_argument(
        "--rss-margin-mb",
        type=float,
        default=None,
        help="judge memory: each process must stay under its start (+ the KV cache for a rank) + this",
    )
    parser.add_argument(
        "--rss-flat-pct",
        type=float,
        default=5.0,
        help="with --rss-margin-mb: the most a process may grow over the last half, in %% (default 5)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("server_args", nargs="*", help="launch_server flags (after --)")
    args = parser.parse_args()
    if args.minutes <= 0 or args.interval <= 0 or args.concurrency < 1:
        parser.error("--minutes and --interval must be positive, --concurrency at least 1")
    if args.min_prompt_tokens < 1 or (
        args.max_prompt_tokens is not None and args.max_prompt_tokens < args.min_prompt_tokens
    ):
        parser.error("--min-prompt-tokens must be at least 1 and --max-prompt-tokens at least that")
    if (args.rss_margin_mb is not None and args.rss_margin_mb < 0) or args.rss_flat_pct < 0:
        parser.error("--rss-margin-mb and --rss-flat-pct must not be negative")
    if args.url is not None and args.server_args:
        parser.error("--url soaks a running server: it takes no launch_server flags")
    if args.url is not None:
        return soak(args.url.rstrip("/"), args, None)
    with ServerProcess(args.server_args, args.startup_timeout) as server:
        budget = [ln for ln in server.output().splitlines() if "KV cache budget" in ln]
        return soak(server.url, args, budget[-1].split("] ", 1)[-1] if budget else None)


if __name__ == "__main__":
    sys.exit(main())
