"""Control-plane cost, idle CPU and memory of a live server (the CPU targets of issue 7).

    python scripts/bench_control_plane.py [--model-path P] [--tokenizer-path P] [--tp-size 3] [--pp-size 1] [--dtype D] \\
        [--num-prompts 16] [--concurrency 16] [--input-len 128] [--output-len 64] [--idle-seconds 10] \\
        [--mem-fraction-static 0.8 [0.6 ...]] [--max-total-tokens N] [--seed 0] [--json out.json]

Starts a server with --enable-metrics, sends one warmup request, then the bench_serving workload
(greedy, ignore_eos, at most --concurrency in flight), and reads every rank's step timing from
/metrics before and after it (`srt:step_{broadcast,schedule,forward}_seconds_total{rank}`,
scheduler/stats.py StepTimer). Per rank: ms per busy step in receive + `broadcast_pyobj`, in
scheduling (messages, batch selection, result processing, outputs) and in forward + sample, and the
control plane's share (broadcast + scheduling) of the step; target <= 5%.

Then the server sits idle --idle-seconds and the CPU time (user + system) of every process of its
tree is read before and after (psutil): % of one core per process and in total; target < 5%.

Then memory: RSS and USS per process after the workload, and the KV cache against the budget that
--mem-fraction-static allows (mem_cache/budget.py: each rank measures, after loading its weights,
available memory - total x (1 - fraction), shared by the ranks of the node; so the KV cache of all
ranks stays below "available before the server started - total x (1 - fraction)"). KV pages come
from torch.empty: on CPU they are resident only once written. Each further --mem-fraction-static
value starts the server again only to read its KV size, to show that it follows the fraction.

The targets are reported (PASS / FAIL), not enforced: timing on a shared machine is noisy. Exit
status 1 when a server does not start or the workload completes no request. The bundled
SmolLM2-135M has 9 attention heads (3 KV heads): it runs at --tp-size 1, 3 or 9, not 2 (the server
refuses 2 at start-up and this script exits 1 with that message), hence the default of 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

SCRIPTS = Path(__file__).resolve().parent
for path in (SCRIPTS, SCRIPTS.parent):  # the sibling bench modules, and this checkout installed or not
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_serving  # noqa: E402
from bench_clients import HTTP_ERRORS, http_call  # noqa: E402
from bench_configs import warmup  # noqa: E402

from srt.server_process import ServerProcess  # noqa: E402

CONTROL_PLANE_TARGET_PCT = 5.0  # broadcast + scheduling, of a busy step
IDLE_CPU_TARGET_PCT = 5.0  # the whole idle server, of one core
KV_SLACK = 0.01  # of total memory: other processes may free memory while the ranks measure theirs
SETTLE_S = 1.0  # after the workload, before the idle window
MB, GB = 1e6, 1e9
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# ---- step timing: every rank's seconds from /metrics ----
@dataclass(frozen=True)
class RankTiming:
    rank: int
    name: str
    steps: int  # busy steps timed; the same on every rank, which all schedule the same batches
    forward_steps: int  # every forward step, the first of each burst too (it began idle: not timed)
    broadcast_s: float
    schedule_s: float
    forward_s: float

    def ms_per_step(self, seconds: float) -> float:
        return 1000 * seconds / self.steps if self.steps else 0.0

    @property
    def control_plane_pct(self) -> float:
        total = self.broadcast_s + self.schedule_s + self.forward_s
        return 100 * (self.broadcast_s + self.schedule_s) / total if total > 0 else 0.0


def parse_metrics(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def rank_name(rank: int, tp_size: int, pp_size: int) -> str:
    """As the rank's process title says it (launcher/layout.py), without `srt::`."""
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    return f"scheduler_PP{pp_rank}_TP{tp_rank}" if pp_size > 1 else f"scheduler_TP{tp_rank}"


def rank_timings(before: Samples, after: Samples, steps: int, tp_size: int, pp_size: int) -> list[RankTiming]:
    """What each rank's counters gained between two scrapes; `steps`: the timed steps meanwhile."""
    ranks = sorted({int(dict(labels)["rank"]) for name, labels in after if name == "srt:forward_steps_total"})
    if not ranks:
        raise RuntimeError("/metrics has no srt:forward_steps_total{rank} series (is --enable-metrics on?)")

    def gained(name: str, rank: int) -> float:
        key = (name, (("rank", str(rank)),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    return [
        RankTiming(
            rank,
            rank_name(rank, tp_size, pp_size),
            steps,
            round(gained("srt:forward_steps_total", rank)),
            gained("srt:step_broadcast_seconds_total", rank),
            gained("srt:step_schedule_seconds_total", rank),
            gained("srt:step_forward_seconds_total", rank),
        )
        for rank in ranks
    ]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / MB:.1f} MB"


def format_timing_table(rows: list[RankTiming], title: str) -> str:
    header = (
        f"{'rank':>4}  {'process':<16}{'timed steps':>12}{'broadcast ms/step':>19}{'schedule ms/step':>18}"
        f"{'forward ms/step':>17}{'control plane %':>17}{'target':>8}"
    )
    lines = [f" {title} ".center(len(header), "="), header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.rank:>4}  {r.name:<16}{r.steps:>12}{r.ms_per_step(r.broadcast_s):>19.3f}"
            f"{r.ms_per_step(r.schedule_s):>18.3f}{r.ms_per_step(r.forward_s):>17.3f}"
            f"{r.control_plane_pct:>17.2f}{verdict(r.control_plane_pct <= CONTROL_PLANE_TARGET_PCT):>8}"
        )
    worst = max(r.control_plane_pct for r in rows)
    lines.append(
        f"control plane (broadcast + scheduling): at most {worst:.2f}% of a busy step "
        f"(target <= {CONTROL_PLANE_TARGET_PCT:g}%): {verdict(worst <= CONTROL_PLANE_TARGET_PCT)}"
    )
    return "\n".join(lines)


# ---- the process tree: idle CPU and memory ----
def process_name(proc: psutil.Process) -> str:
    """The process title the launcher gave it (srt::scheduler_TP1 -> scheduler_TP1), `main` for the
    launch_server process, else the multiprocessing helper's or the executable's name."""
    try:
        cmdline = " ".join(proc.cmdline()).strip()
    except psutil.Error:
        return "?"
    if cmdline.startswith("srt::"):
        return cmdline.removeprefix("srt::").split()[0]
    if "srt.launch_server" in cmdline:
        return "main"
    helper = re.search(r"multiprocessing\.(\w+)", cmdline)
    return helper[1] if helper else proc.name()


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@dataclass(frozen=True)
class ProcessCpu:
    name: str
    pid: int
    cpu_s: float  # user + system over the window
    pct_of_core: float


def cpu_seconds(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


def idle_cpu(procs: list[psutil.Process], seconds: float) -> tuple[list[ProcessCpu], float]:
    """CPU time of each process over `seconds` of doing nothing here; and the window's length."""
    before = {p.pid: cpu_seconds(p) for p in procs}
    start = time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - start
    rows = []
    for p in procs:
        first, last = before[p.pid], cpu_seconds(p)
        if first is not None and last is not None:
            rows.append(ProcessCpu(process_name(p), p.pid, last - first, 100 * (last - first) / wall))
    return rows, wall


def format_idle_table(rows: list[ProcessCpu], wall: float) -> str:
    header = f"{'process':<20}{'pid':>8}{'cpu s':>10}{'% of one core':>15}"
    lines = [f" idle server, {wall:.1f} s ".center(len(header), "="), header, "-" * len(header)]
    lines += [f"{r.name:<20}{r.pid:>8}{r.cpu_s:>10.3f}{r.pct_of_core:>15.2f}" for r in rows]
    total = sum(r.pct_of_core for r in rows)
    lines.append(f"{'total':<20}{'':>8}{sum(r.cpu_s for r in rows):>10.3f}{total:>15.2f}")
    lines.append(
        f"idle server: {total:.2f}% of one core (target < {IDLE_CPU_TARGET_PCT:g}%): "
        f"{verdict(total < IDLE_CPU_TARGET_PCT)}"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class ProcessMemory:
    name: str
    pid: int
    rss: int  # bytes
    uss: int | None  # bytes only this process holds (None where /proc/PID/smaps is unreadable)


def process_memory(procs: list[psutil.Process]) -> list[ProcessMemory]:
    rows = []
    for p in procs:
        try:
            rss = int(p.memory_info().rss)
        except psutil.Error:
            continue
        try:
            uss: int | None = int(p.memory_full_info().uss)
        except psutil.Error:
            uss = None
        rows.append(ProcessMemory(process_name(p), p.pid, rss, uss))
    return rows


def format_memory_table(rows: list[ProcessMemory]) -> str:
    header = f"{'process':<20}{'pid':>8}{'RSS MB':>10}{'USS MB':>10}"
    lines = [" resident memory after the workload ".center(len(header), "="), header, "-" * len(header)]
    for r in rows:
        uss = "n/a" if r.uss is None else f"{r.uss / MB:.1f}"
        lines.append(f"{r.name:<20}{r.pid:>8}{r.rss / MB:>10.1f}{uss:>10}")
    lines.append(
        f"{'total':<20}{'':>8}{sum(r.rss for r in rows) / MB:>10.1f}{sum(r.uss or 0 for r in rows) / MB:>10.1f}"
    )
    return "\n".join(lines)


# ---- the KV budget ----
@dataclass(frozen=True)
class KvBudget:
    mem_fraction_static: float
    tokens_per_rank: int  # max_total_tokens
    bytes_per_rank: int  # the output rank's pool; every rank holds the same pages
    ranks: int  # on this node, which share its memory
    total_memory: int
    available_before: int  # when the server was started
    max_total_tokens_flag: int | None

    @property
    def kv_bytes(self) -> int:
        return self.bytes_per_rank * self.ranks

    @property
    def kept_free(self) -> int:
        return int(self.total_memory * (1 - self.mem_fraction_static))

    @property
    def budget(self) -> int:
        """What mem_cache/budget.py lets the ranks' KV take together, measured from outside."""
        return max(self.available_before - self.kept_free, 0)

    @property
    def honoured(self) -> bool:
        return self.kv_bytes <= self.budget + KV_SLACK * self.total_memory


def kv_budget(
    info: dict[str, Any], state: dict[str, Any], available_before: int, max_total_tokens_flag: int | None
) -> KvBudget:
    return KvBudget(
        float(info["mem_fraction_static"]),
        int(info["max_total_tokens"]),
        int(state["kv_cache_bytes"]),
        int(info["tp_size"]) * int(info["pp_size"]) // int(info["nnodes"]),
        int(psutil.virtual_memory().total),
        available_before,
        max_total_tokens_flag,
    )


def format_kv_detail(kv: KvBudget) -> str:
    f = kv.mem_fraction_static
    capped = f", capped by --max-total-tokens {kv.max_total_tokens_flag}" if kv.max_total_tokens_flag else ""
    return "\n".join(
        [
            f"machine memory: total {size(kv.total_memory)}, available before the server started "
            f"{size(kv.available_before)}",
            f"kept free: total x (1 - {f:g}) = {size(kv.kept_free)}; KV budget: available - kept free = "
            f"{size(kv.budget)} for {kv.ranks} rank(s) (mem_cache/budget.py)",
            f"KV cache: {kv.tokens_per_rank} tokens x {kv.bytes_per_rank // max(kv.tokens_per_rank, 1)} B/token per rank "
            f"x {kv.ranks} rank(s) = {size(kv.kv_bytes)}{capped} (allocated lazily: resident once written)",
            f"KV cache honours --mem-fraction-static {f:g}: {verdict(kv.honoured)} "
            f"(KV <= budget + {KV_SLACK:.0%} of total memory for other processes' churn)",
        ]
    )


def format_kv_table(rows: list[KvBudget]) -> str:
    header = (
        f"{'mem-fraction-static':>20}{'KV tokens/rank':>16}{'KV MB (all ranks)':>19}{'budget MB':>11}"
        f"{'KV / budget':>13}{'honoured':>10}"
    )
    lines = [" KV cache vs --mem-fraction-static ".center(len(header), "="), header, "-" * len(header)]
    for kv in rows:
        share = f"{100 * kv.kv_bytes / kv.budget:.1f}%" if kv.budget else "n/a"
        lines.append(
            f"{kv.mem_fraction_static:>20g}{kv.tokens_per_rank:>16}{kv.kv_bytes / MB:>19.1f}"
            f"{kv.budget / MB:>11.0f}{share:>13}{verdict(kv.honoured):>10}"
        )
    return "\n".join(lines)


# ---- runs ----
def server_flags(args: argparse.Namespace, mem_fraction_static: float) -> list[str]:
    flags = [
        "--tp-size",
        str(args.tp_size),
        "--pp-size",
        str(args.pp_size),
        "--enable-metrics",
        "--mem-fraction-static",
        str(mem_fraction_static),
    ]
    for flag, value in (
        ("--model-path", args.model_path),
        ("--tokenizer-path", args.tokenizer_path),
        ("--dtype", args.dtype),
        ("--max-total-tokens", args.max_total_tokens),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def server_info(url: str) -> dict[str, Any]:
    response = http_call(f"{url}/server_info", timeout_s=60)
    if response.status != 200:
        raise RuntimeError(f"GET /server_info answered {response.status}: {response.text[:200]}")
    return response.json()


def scrape(url: str) -> Samples:
    response = http_call(f"{url}/metrics", timeout_s=60)
    if response.status != 200:
        raise RuntimeError(f"GET /metrics answered {response.status}: {response.text[:200]}")
    return parse_metrics(response.text)


def full_run(args: argparse.Namespace, mem_fraction_static: float) -> dict[str, Any]:
    """Workload with step timing, idle CPU, memory and the KV budget, on one server."""
    available = int(psutil.virtual_memory().available)
    with ServerProcess(server_flags(args, mem_fraction_static), args.startup_timeout) as server:
        warmup(server.url, args.input_len)
        steps_before = server_info(server.url)["internal_states"][0]["step_timing"]["steps"]
        before = scrape(server.url)
        bench_args = bench_serving.parse_args(
            [
                "--base-url",
                server.url,
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--max-concurrency",
                str(args.concurrency),
                "--seed",
                str(args.seed),
                "--request-timeout",
                str(args.request_timeout),
            ]
        )
        serving, _ = asyncio.run(bench_serving.benchmark(bench_args))
        after = scrape(server.url)
        info = server_info(server.url)
        state = info["internal_states"][0]
        timings = rank_timings(
            before,
            after,
            int(state["step_timing"]["steps"] - steps_before),
            int(info["tp_size"]),
            int(info["pp_size"]),
        )
        print(
            format_timing_table(
                timings,
                f"step timing at TP={info['tp_size']} PP={info['pp_size']}, {serving.completed} requests, "
                f"input {args.input_len}, output {args.output_len}",
            ),
            flush=True,
        )
        procs = process_tree(server.proc.pid)
        time.sleep(SETTLE_S)
        idle, wall = idle_cpu(procs, args.idle_seconds)
        print(format_idle_table(idle, wall), flush=True)
        memory = process_memory(procs)
        print(format_memory_table(memory), flush=True)
        kv = kv_budget(info, state, available, args.max_total_tokens)
        print(format_kv_detail(kv), flush=True)
    return {
        "completed": serving.completed,
        "failed": serving.failed,
        "output_throughput": serving.output_throughput,
        "step_timing": [asdict(t) for t in timings],
        "idle_window_s": wall,
        "idle_cpu": [asdict(r) for r in idle],
        "memory": [asdict(r) for r in memory],
        "kv": kv,
    }


def kv_run(args: argparse.Namespace, mem_fraction_static: float) -> KvBudget:
    """Start, read the KV size, stop."""
    available = int(psutil.virtual_memory().available)
    with ServerProcess(server_flags(args, mem_fraction_static), args.startup_timeout) as server:
        info = server_info(server.url)
    return kv_budget(info, info["internal_states"][0], available, args.max_total_tokens)


# ---- command line ----
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer-path", default=None, help="default: --model-path")
    parser.add_argument(
        "--tp-size",
        "--tp",
        dest="tp_size",
        type=int,
        default=3,
        help="default: %(default)s (the bundled SmolLM2 has 9 heads: 2 does not divide them)",
    )
    parser.add_argument("--pp-size", "--pp", dest="pp_size", type=int, default=1, help="default: %(default)s")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("auto", "bfloat16", "float16", "float32"),
        help="default: the server's",
    )
    parser.add_argument("--num-prompts", type=int, default=16, help="default: %(default)s")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="requests in flight at most; default: %(default)s"
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens; default: %(default)s")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens; default: %(default)s")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle window; default: %(default)s")
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        nargs="+",
        default=[0.8],
        help="the first runs everything; each further value only reads the KV size; default: 0.8",
    )
    parser.add_argument(
        "--max-total-tokens", type=int, default=None, help="cap on the KV cache; default: none"
    )
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server start")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("tp_size", "pp_size", "num_prompts", "concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("idle_seconds", "startup_timeout", "request_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    if not all(0 < f < 1 for f in args.mem_fraction_static):
        parser.error(f"--mem-fraction-static values must be in (0, 1), got {args.mem_fraction_static}")
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        parser.error(f"--max-total-tokens must be >= 1, got {args.max_total_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = full_run(args, args.mem_fraction_static[0])
        budgets = [report["kv"]] + [kv_run(args, f) for f in args.mem_fraction_static[1:]]
    except HTTP_ERRORS + (RuntimeError,) as error:
        print(f"bench_control_plane: {error}", file=sys.stderr)
        return 1
    print(format_kv_table(budgets), flush=True)
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report["kv"] = [
            {**asdict(kv), "kv_bytes": kv.kv_bytes, "budget": kv.budget, "honoured": kv.honoured}
            for kv in budgets
        ]
        args.json.write_text(json.dumps({"config": config, **report}, indent=2))
    return 0 if report["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
