"""scripts/bench_speculative.py: its prompt sets and the bound on n-gram drafting it prints (the run
itself is measured by hand, docs/performance.md)."""

from __future__ import annotations

import bench_speculative as bench


def test_a_base_model_gets_the_same_tasks_as_text() -> None:
    assert len(bench.REPETITIVE_TEXT) == len(bench.REPETITIVE)
    assert [t.split("\n")[0] for t in bench.CHAT_TEXT] == [f"Question: {q}" for q in bench.CHAT]


def test_ngram_bound_counts_the_steps_of_the_best_earlier_continuation() -> None:
    # The answer copies the prompt: its first token comes from the prefill, one step drafts the rest.
    assert bench.ngram_bound([[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5, 6]]) == 5.0
    # Nothing repeats: a step a token.
    assert bench.ngram_bound([[1, 2]], [[3, 4, 5]]) == 1.0
    # Of the two earlier 7s the second goes on as the answer does (8, 9), the first only for 8:
    # steps: 7 -> [8, 9] + the next sampled token (5), then 6 alone. 4 plain steps, 2 with drafts.
    assert bench.ngram_bound([[7, 8, 1, 7, 8, 9]], [[7, 8, 9, 5, 6]]) == 2.0
    # Summed over a set: 5 + 2 plain steps over 1 + 2 drafting ones.
    assert bench.ngram_bound([[1, 2, 3, 4, 5, 6], [1, 2]], [[1, 2, 3, 4, 5, 6], [3, 4, 5]]) == 7 / 3
