"""A PNG of a concurrency sweep: throughput (left) and latency percentiles (right) against the
number of requests in flight. matplotlib (`pip install matplotlib`, or the project's `bench` extra)
is imported only here, with the Agg backend, so no display is needed."""

from __future__ import annotations

from pathlib import Path

from bench_metrics import LatencyStats, LevelResult

LATENCY_SERIES = (
    ("TTFT", "ttft_ms", "tab:blue"),
    ("ITL", "itl_ms", "tab:orange"),
    ("E2E", "e2e_ms", "tab:green"),
)


def plot_sweep(levels: list[LevelResult], path: Path, title: str, unlimited_x: int) -> None:
    """Writes the PNG at `path`. A level without a concurrency limit is drawn at x = `unlimited_x`
    (the number of prompts: with all of them sent at once, at most that many are in flight)."""
    if not levels:
        raise ValueError("nothing to plot: no concurrency levels")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, NullLocator

    xs = [level.concurrency if level.concurrency is not None else unlimited_x for level in levels]
    figure, (throughput_ax, latency_ax) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    tokens_line = throughput_ax.plot(
        xs, [lv.metrics.output_throughput for lv in levels], "o-", color="tab:blue", label="output tok/s"
    )
    requests_ax = throughput_ax.twinx()
    requests_line = requests_ax.plot(
        xs, [lv.metrics.request_throughput for lv in levels], "s--", color="tab:red", label="requests/s"
    )
    throughput_ax.set_ylabel("output tokens / s")
    requests_ax.set_ylabel("requests / s")
    throughput_ax.set_title("Throughput")
    throughput_ax.legend(handles=tokens_line + requests_line, loc="upper left")
    for name, attr, color in LATENCY_SERIES:
        stats: list[LatencyStats | None] = [getattr(lv.metrics, attr) for lv in levels]
        points = [(x, s) for x, s in zip(xs, stats) if s is not None]
        if points:  # a run without streaming has no TTFT or ITL
            latency_ax.plot(
                [x for x, _ in points], [s.p50 for _, s in points], "o-", color=color, label=f"{name} p50"
            )
            latency_ax.plot(
                [x for x, _ in points], [s.p99 for _, s in points], "o:", color=color, label=f"{name} p99"
            )
    latency_ax.set_yscale("log")
    latency_ax.yaxis.set_major_formatter(LogFormatter())  # 40 rather than 4x10^1
    latency_ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    latency_ax.set_ylabel("latency (ms)")
    latency_ax.set_title("Latency")
    latency_ax.legend(loc="best", fontsize="small")
    labels = [level.label for level in levels]
    for ax in (throughput_ax, latency_ax):
        if len(set(xs)) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, labels)
        ax.xaxis.set_minor_locator(NullLocator())  # only the levels run are ticked
        ax.set_xlabel("max concurrent requests")
        ax.grid(True, alpha=0.3)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
    plt.close(figure)
