"""What scripts/soak.py judges and prints: each request's outcome and whether a healthy server gives
it, latency over time, each process's resident memory at the start and the end and whether it levelled
off under its bound, and the KV cache's
integrity once the server is idle. Pure functions of what the soak recorded, so that a test can feed
them a bad sample."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bench_metrics import percentile

MB = 1 << 20

# ---- outcomes: what a healthy server answers ----
OK = "ok"  # ran to its end, well-formed, with a finish reason that fits the request
REFUSED_400 = "400 expected"  # a bad request refused with a 400 naming the bad parameter
DROPPED = "dropped by client"  # a stream the client closed after a few chunks
ABORTED = "aborted"  # /abort_request ended the stream with finish reason abort
ABORT_TOO_LATE = "finished before abort"  # the abort came after the last token: nothing to abort
BUSY = "503 busy"  # a full waiting queue or a passed deadline; expected only where the server has those
# ---- and what it does not ----
WRONG_PARAM_400 = "400 naming another param"
ACCEPTED_BAD = "bad request accepted"
UNEXPECTED_400 = "400 unexpected"
OTHER_4XX = "4xx other"
SERVER_ERROR = "5xx"
TIMEOUT = "timeout"
CONNECTION = "connection error"
MALFORMED_STREAM = "malformed stream"
MALFORMED_RESPONSE = "malformed response"
WRONG_FINISH = "wrong finish reason"

EXPECTED = frozenset({OK, REFUSED_400, DROPPED, ABORTED, ABORT_TOO_LATE})
SHOWN_EXAMPLES = 3  # details printed for each unexpected outcome


def expected_outcomes(server_info: dict[str, Any]) -> frozenset[str]:
    """A 503 is the promised answer only from a server that bounds its queue or its requests' time."""
    limits = ("max_queued_requests", "req_waiting_timeout", "req_running_timeout")
    return EXPECTED | {BUSY} if any(server_info.get(k) is not None for k in limits) else EXPECTED


@dataclass(frozen=True)
class Record:
    """One request of the soak. Times are seconds."""

    kind: str  # the traffic kind (soak.py KINDS)
    outcome: str
    end_s: float  # when it ended, since the traffic started
    e2e_s: float | None = None  # sent to last byte, for a request that ran to its end
    ttft_s: float | None = None  # sent to the first chunk with tokens, for a stream
    prompt: str = ""  # the prompt's shape (soak.py Prompts), "" without one
    detail: str = ""  # what was wrong, for an unexpected outcome


def http_failure(status: int) -> str:
    """The outcome of a valid request answered with `status` (not 200)."""
    if status == 400:
        return UNEXPECTED_400
    if status == 503:
        return BUSY
    return SERVER_ERROR if status >= 500 else OTHER_4XX


def judge_refusal(status: int, body: Any, param: str | None) -> tuple[str, str]:
    """A bad request's answer: a 400 whose error names `param` (None: a body that is not JSON)."""
    if status == 200:
        return ACCEPTED_BAD, f"expected a 400 naming {param!r}, got 200"
    if status != 400:
        return http_failure(status), f"expected a 400 naming {param!r}, got {status}: {str(body)[:200]}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or error.get("param") != param:
        return WRONG_PARAM_400, f"expected param {param!r}: {str(body)[:200]}"
    return REFUSED_400, ""


# ---- streams ----
DONE = object()  # what sse_events yields for `data: [DONE]`


class MalformedStream(Exception):
    pass


def lines_of(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a body read in pieces as they arrive (requests' iter_lines waits for full reads)."""
    pending = b""
    for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        yield from lines
    if pending:
        yield pending


def sse_events(lines: Iterable[bytes]) -> Iterator[Any]:
    """Each `data:` event's JSON, then DONE; MalformedStream on anything else (blank lines between
    events are fine) and on an event after [DONE]."""
    done = False
    for line in lines:
        line = line.rstrip(b"\r")
        if not line:
            continue
        if done:
            raise MalformedStream(f"data after [DONE]: {line[:100]!r}")
        if not line.startswith(b"data:"):
            raise MalformedStream(f"not an SSE data line: {line[:100]!r}")
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            yield DONE
            continue
        try:
            yield json.loads(data)
        except ValueError:
            raise MalformedStream(f"not JSON: {data[:100]!r}") from None


def stream_error(event: Any) -> tuple[str, str] | None:
    """The outcome of an error event inside a stream (a 200 whose body failed later), else None."""
    if isinstance(event, dict) and "error" in event:
        error = event["error"]
        code = error.get("code") if isinstance(error, dict) else None
        return http_failure(code if isinstance(code, int) else 500), f"error event: {str(error)[:200]}"
    return None


def judge_generate(out: Any, max_new_tokens: int, n_ids: int, abort_sent: bool = False) -> tuple[str, str]:
    """/generate's last output (the response, or a stream's last chunk) for a request of
    `max_new_tokens`, of which the client received `n_ids` ids in all; `abort_sent`: the client
    asked /abort_request to end it."""
    try:
        meta = out["meta_info"]
        finish = meta["finish_reason"]
        completion = meta["completion_tokens"]
    except (KeyError, TypeError):
        return MALFORMED_RESPONSE, f"no meta_info.finish_reason / completion_tokens: {str(out)[:200]}"
    if finish is None:
        return WRONG_FINISH, "the last output has no finish reason"
    kind = finish.get("type") if isinstance(finish, dict) else None
    if n_ids != completion:
        return MALFORMED_RESPONSE, f"{n_ids} output ids but completion_tokens {completion}"
    if kind == "abort":
        if abort_sent:
            return ABORTED, ""
        return WRONG_FINISH, f"aborted: {finish.get('message')!r}"
    if kind == "length" and completion != max_new_tokens:
        return WRONG_FINISH, f"finish length after {completion} of max_new_tokens {max_new_tokens}"
    if kind not in ("length", "stop") or completion > max_new_tokens:
        return WRONG_FINISH, f"finish {finish} after {completion} of max_new_tokens {max_new_tokens}"
    return (ABORT_TOO_LATE if abort_sent else OK), ""


def judge_completion(finish_reason: Any, usage: Any, max_tokens: int) -> tuple[str, str]:
    """/v1/completions' one choice: its finish reason and the response's (or the last chunk's) usage."""
    if finish_reason not in ("length", "stop"):
        return WRONG_FINISH, f"finish_reason {finish_reason!r}"
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(completion, int):
        return MALFORMED_RESPONSE, f"no usage.completion_tokens: {str(usage)[:200]}"
    if completion > max_tokens or (finish_reason == "length" and completion != max_tokens):
        return WRONG_FINISH, f"finish {finish_reason} after {completion} of max_tokens {max_tokens}"
    return OK, ""


# ---- tables ----
def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) * 1000 if values else None


def interval_row(
    records: list[Record], start_s: float, end_s: float, expected: frozenset[str]
) -> dict[str, Any]:
    """The requests that ended in (start_s, end_s]: how many, how many unexpected, and the p50 / p99
    end-to-end latency (of those that ran to their end) and time to first token (of streams), in ms."""
    window = [r for r in records if start_s < r.end_s <= end_s]
    e2e = [r.e2e_s for r in window if r.e2e_s is not None]
    ttft = [r.ttft_s for r in window if r.ttft_s is not None]
    return {
        "t_s": end_s,
        "requests": len(window),
        "unexpected": sum(r.outcome not in expected for r in window),
        "e2e_p50_ms": _pct(e2e, 50),
        "e2e_p99_ms": _pct(e2e, 99),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
    }


LATENCY_COLUMNS = ("e2e_p50_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms")


def over_time_header(sample: dict[str, Any]) -> str:
    return (
        f"{'t (s)':>6} {'reqs':>5} {'unexp':>5} {'e2e p50':>8} {'e2e p99':>8} {'ttft p50':>8} {'ttft p99':>8}"
        f" {'KV cached/free':>15}  "
        + "  ".join(f"{n + ' MB':>14}" for n in sample["processes"])
        + "\n"
        + f"{'':>6} {'':>5} {'':>5} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8}"
    )


def over_time_row(row: dict[str, Any], sample: dict[str, Any], names: Iterable[str]) -> str:
    """One row of the over-time table: the interval's requests and latency, then the sample's KV
    pages and each process's RSS (by the first sample's `names`; '-' for one gone)."""
    ms = " ".join("       -" if row[c] is None else f"{row[c]:>8.0f}" for c in LATENCY_COLUMNS)
    kv = f"{sample['cached_pages']}/{sample['free_pages']}"
    procs = sample["processes"]
    rss = "  ".join(f"{procs[n]['rss_bytes'] / MB:>14.0f}" if n in procs else f"{'-':>14}" for n in names)
    return f"{row['t_s']:>6.0f} {row['requests']:>5} {row['unexpected']:>5} {ms} {kv:>15}  {rss}"


def outcome_counts(records: list[Record]) -> dict[str, dict[str, int]]:
    """{outcome: {traffic kind: count}}."""
    counts: dict[str, Counter[str]] = {}
    for r in records:
        counts.setdefault(r.outcome, Counter())[r.kind] += 1
    return {outcome: dict(c) for outcome, c in sorted(counts.items())}


def outcome_table(records: list[Record], kinds: list[str], expected: frozenset[str]) -> str:
    """Every outcome (a row) by traffic kind (a column), each row marked expected or UNEXPECTED,
    then a few details of each unexpected outcome."""
    counts = outcome_counts(records)
    width = max([len(o) for o in counts] + [len("outcome")])
    lines = [
        f"{'outcome':<{width}} {'total':>6} " + " ".join(f"{k:>9}" for k in kinds) + "  judged",
    ]
    for outcome, by_kind in counts.items():
        judged = "expected" if outcome in expected else "UNEXPECTED"
        lines.append(
            f"{outcome:<{width}} {sum(by_kind.values()):>6} "
            + " ".join(f"{by_kind.get(k, 0):>9}" for k in kinds)
            + f"  {judged}"
        )
    for outcome in counts:
        if outcome not in expected:
            shown = [r for r in records if r.outcome == outcome][:SHOWN_EXAMPLES]
            lines += [f"  {outcome} ({r.kind}, {r.prompt or 'no'} prompt): {r.detail}" for r in shown]
    return "\n".join(lines)


def rss_table(first: dict[str, Any], last: dict[str, Any]) -> str:
    """Each process's RSS at the start and the end and the change (MB = 2^20 bytes)."""
    lines = [f"{'process':<16} {'pid':>16} {'start MB':>9} {'end MB':>9} {'change MB':>10}"]
    for name in dict.fromkeys([*first["processes"], *last["processes"]]):
        a, b = first["processes"].get(name), last["processes"].get(name)
        pid = f"{a['pid']}->{b['pid']}" if a and b and a["pid"] != b["pid"] else str((a or b)["pid"])
        start = f"{a['rss_bytes'] / MB:>9.0f}" if a else f"{'-':>9}"
        end = f"{b['rss_bytes'] / MB:>9.0f}" if b else f"{'-':>9}"
        change = f"{(b['rss_bytes'] - a['rss_bytes']) / MB:>+10.0f}" if a and b else f"{'-':>10}"
        lines.append(f"{name:<16} {pid:>16} {start} {end} {change}")
    return "\n".join(lines)


def rss_verdict(
    samples: list[dict[str, Any]], kv_bytes: int, margin_bytes: float | None, flat_pct: float
) -> dict[str, Any]:
    """Whether each process's RSS levelled off under its bound. The last half of the run is the
    samples from the last one at or before half the last sample's time; a process is flat when its
    highest RSS there is at most `flat_pct` % above its RSS at that half-way sample, and under its
    bound when its highest RSS of the whole run is at most its first RSS (the model loaded, the KV
    pool not yet written) plus `kv_bytes` for a rank ("scheduler ..." processes) plus
    `margin_bytes`. Returns {"half_t_s", "rows" (one per process of the first sample, bytes),
    "problems"}: the problems say what failed, with the bound only where `margin_bytes` is given."""
    half_t = samples[-1]["t_s"] / 2
    half = [s for s in samples if s["t_s"] <= half_t][-1]
    rows, problems = [], []
    for name, first in samples[0]["processes"].items():
        seen = [s["processes"][name]["rss_bytes"] for s in samples if name in s["processes"]]
        later = [
            s["processes"][name]["rss_bytes"]
            for s in samples
            if s["t_s"] >= half["t_s"] and name in s["processes"]
        ]
        if name not in half["processes"] or not later:
            problems.append(f"{name}: no sample in the last half")
            continue
        at_half = half["processes"][name]["rss_bytes"]
        growth = max(later) - at_half
        bound = None
        if margin_bytes is not None:
            bound = first["rss_bytes"] + (kv_bytes if name.startswith("scheduler") else 0) + margin_bytes
        row = {
            "name": name,
            "start": first["rss_bytes"],
            "half": at_half,
            "end": seen[-1],
            "peak": max(seen),
            "growth": growth,
            "growth_pct": 100.0 * growth / at_half,
            "bound": bound,
        }
        row["flat"] = row["growth_pct"] <= flat_pct
        row["under"] = bound is None or row["peak"] <= bound
        rows.append(row)
        if not row["flat"]:
            problems.append(
                f"{name} grew {growth / MB:.0f} MB ({row['growth_pct']:.1f}%) over the last half, "
                f"more than {flat_pct:g}%"
            )
        if not row["under"]:
            problems.append(
                f"{name} reached {row['peak'] / MB:.0f} MB, above its bound of {bound / MB:.0f} MB"
            )
    return {"half_t_s": half["t_s"], "rows": rows, "problems": problems}


def rss_verdict_table(verdict: dict[str, Any]) -> str:
    """rss_verdict's rows, in MB: start, half-way, end, peak, growth over the last half, bound."""
    lines = [
        f"{'process':<16} {'start':>7} {'half':>7} {'end':>7} {'peak':>7} {'last half':>15} {'bound':>7}  verdict"
    ]
    for r in verdict["rows"]:
        bound = "-" if r["bound"] is None else f"{r['bound'] / MB:.0f}"
        growth = f"{r['growth'] / MB:+.0f} ({r['growth_pct']:+.1f}%)"
        verdict_word = ("flat" if r["flat"] else "GROWING") + ("" if r["under"] else ", OVER BOUND")
        lines.append(
            f"{r['name']:<16} {r['start'] / MB:>7.0f} {r['half'] / MB:>7.0f} {r['end'] / MB:>7.0f} "
            f"{r['peak'] / MB:>7.0f} {growth:>15} {bound:>7}  {verdict_word}"
        )
    return "\n".join(lines)


# ---- integrity ----
def process_problems(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """A process gone or replaced (an engine restart: a rank died) since the first sample."""
    problems = []
    for name, proc in first["processes"].items():
        now = last["processes"].get(name)
        if now is None:
            problems.append(f"process {name} (pid {proc['pid']}) is gone")
        elif now["pid"] != proc["pid"]:
            problems.append(f"process {name} was replaced (pid {proc['pid']} -> {now['pid']})")
    return problems


def busy(state: dict[str, Any]) -> bool:
    return bool(state["running"] or state["waiting"] or state["chunked"])


def kv_problems(idle: dict[str, Any], flushed: dict[str, Any] | None) -> list[str]:
    """What is wrong with the KV cache of an idle server (its internal state) and, after
    /flush_cache, of the flushed one (None: not flushed). Idle, every page is free or held by the
    prefix cache; flushed, every page is free."""
    problems = []
    if busy(idle):
        problems.append("the server was not idle")
    for when, state in (("idle", idle), ("after /flush_cache", flushed)):
        if state is None:
            continue
        if state.get("kv_integrity_error"):
            problems.append(f"{when}: the server's own check: {state['kv_integrity_error']}")
        free, cached, total = state["free_pages"], state["cached_pages"], state["num_pages"]
        if free + cached != total:
            problems.append(
                f"{when}: {free} free + {cached} cached pages != {total} pages ({total - free - cached} leaked)"
            )
    if flushed is not None and (flushed["free_pages"] != flushed["num_pages"] or flushed["used_pages"]):
        problems.append(
            f"after /flush_cache: {flushed['used_pages']} pages still used, "
            f"{flushed['free_pages']} of {flushed['num_pages']} free"
        )
    return problems


def metric_total(text: str, name: str) -> float | None:
    """The sum of a Prometheus text exposition's samples of `name` (every label set), None if absent."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    ]
    return sum(values) if values else None
