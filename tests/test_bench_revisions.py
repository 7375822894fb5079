"""scripts/bench_revisions.py: medians over rounds per batch size, and the side-by-side table."""

from __future__ import annotations

import bench_revisions as bench


def result(bs: int, prefill: float, decode_ms: float) -> dict[str, float]:
    return {"batch_size": bs, "prefill_tok_s": prefill, "decode_ms_per_step": decode_ms}


def test_medians_are_per_batch_size_over_rounds() -> None:
    rounds = [
        [result(1, 100, 10), result(8, 800, 20)],
        [result(1, 300, 30), result(8, 400, 40)],
        [result(1, 200, 20)],
    ]
    assert bench.medians(rounds, "prefill_tok_s") == {1: 200, 8: 600}
    assert bench.medians(rounds, "decode_ms_per_step") == {1: 20, 8: 30}


def test_the_table_puts_head_over_base() -> None:
    base = [[result(1, 1000, 10.0)], [result(1, 1000, 10.0)]]
    head = [[result(1, 1100, 9.0)], [result(1, 900, 9.0)]]
    rows = bench.table(base, head).splitlines()
    assert rows[0].startswith("| batch |") and len(rows) == 3
    assert rows[2] == "| 1 | 1000 | 1000 | 1.000 | 10.00 | 9.00 | 0.900 |"
