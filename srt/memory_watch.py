"""Host memory pressure, as the front end sees it.

Only the front end reads the host's available memory (psutil): a rank deciding from its own
reading would evict or refuse at a different iteration than the others, and their schedules
would part (ARCHITECTURE.md, "The one invariant"). Below `--min-available-memory`:

- new requests get 503 (`TokenizerManager.parse_generate`) until memory is back above it;
- a `ReleaseMemoryReq` goes through rank 0's broadcast, so every rank evicts its unlocked prefix
  cache and gives the free KV pages back to the OS in the same iteration; again every
  `REPEAT_S` while the pressure lasts (running requests finish into the cache meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import psutil

logger = logging.getLogger("srt.memory_watch")

GIB = 1 << 30
POLL_S = 1.0
REPEAT_S = 10.0


def available_memory() -> int:
    return int(psutil.virtual_memory().available)


class MemoryWatch:
    """`poll(now)` once a second: whether to ask the ranks to release memory; `pressure` says why
    new requests are refused (None while memory suffices). `threshold` in bytes, 0: off."""

    def __init__(self, threshold: int, read: Callable[[], int] = available_memory) -> None:
        self.threshold = threshold
        self.read = read
        self.pressure: str | None = None
        self._last_release: float | None = None

    def poll(self, now: float) -> bool:
        if self.threshold <= 0:
            return False
        available = self.read()
        if available >= self.threshold:
            if self.pressure is not None:
                logger.info("host memory available again: %.2f GiB", available / GIB)
            self.pressure, self._last_release = None, None
            return False
        self.pressure = (
            f"the host is short of memory: {available / GIB:.2f} GiB available, below "
            f"--min-available-memory {self.threshold / GIB:g} GiB; retry later"
        )
        if self._last_release is not None and now - self._last_release < REPEAT_S:
            return False
        logger.warning("%s; asking the ranks to release their prefix cache", self.pressure)
        self._last_release = now
        return True


def process_memory(processes: list[tuple[str, int]]) -> list[dict[str, int | str]]:
    """Resident bytes (RSS) of each (name, pid) still alive, in the order given."""
    report: list[dict[str, int | str]] = []
    for name, pid in processes:
        try:
            rss = int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:  # gone meanwhile (a restart): leave it out
            continue
        report.append({"name": name, "pid": pid, "rss_bytes": rss})
    return report


class ProcessMemoryCollector:
    """/metrics: `srt:process_resident_memory_bytes{process}` for each process of this node and
    `srt:host_available_memory_bytes`, read when scraped."""

    def __init__(self, processes: Callable[[], list[tuple[str, int]]]) -> None:
        self.processes = processes

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        rss = GaugeMetricFamily(
            "srt:process_resident_memory_bytes",
            "Resident memory of a process of this node",
            labels=["process"],
        )
        for entry in process_memory(self.processes()):
            rss.add_metric([str(entry["name"])], float(entry["rss_bytes"]))
        yield rss
        yield GaugeMetricFamily(
            "srt:host_available_memory_bytes", "Host RAM available (psutil)", value=float(available_memory())
        )
