"""scripts/bench_embeddings.py: its texts and its table (the run itself is measured by hand,
docs/performance.md)."""

from __future__ import annotations

import bench_embeddings as bench


def test_texts_are_seeded_sentences_of_8_to_60_words() -> None:
    texts = bench.texts(50)
    assert texts == bench.texts(50) and texts != bench.texts(50, seed=1)
    assert all(8 <= len(t.split()) <= 60 and t.endswith(".") for t in texts)


def test_table_takes_medians_and_the_ratio() -> None:
    rates = {("srt", 8): [150.0, 90.0, 160.0], ("transformers", 8): [100.0, 50.0, 120.0]}
    lines = bench.table(rates, {8: 0.99991}, [8]).splitlines()
    assert lines[2] == "| 8 | 150.0 | 100.0 | 1.50 | 0.99991 |"
