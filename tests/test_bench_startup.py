"""scripts/bench_startup.py: one real start of the default server, timed to ready with its process
tree's peak memory; a start that never became ready is counted as failed."""

from __future__ import annotations

import bench_startup


def test_a_start_of_the_default_server_is_timed_and_measured() -> None:
    start = bench_startup.one_start(["--max-total-tokens", "4096"], timeout=300, settle=1)
    assert start.ready_s is not None and 0 < start.ready_s < 300
    assert start.peak_rss > 100 * 2**20  # the main process, a rank and the detokenizer
    assert 0 < start.ready_rss <= start.peak_rss


def test_summary_counts_the_failed_starts() -> None:
    table = bench_startup.summary(
        [
            bench_startup.Start(9.5, 2**30, None),
            bench_startup.Start(None, 2**29, 1),
            bench_startup.Start(10.5, 2**30, None),
        ]
    )
    assert "failed (1)" in table
    assert table.splitlines()[-1] == "2 of 3 starts ready; median ready 10.0 s; peak RSS 1024 MB"
