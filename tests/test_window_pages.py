"""Window pages (mem_cache/window_pages.py): a sliding-window layer keeps only its window's K/V.

The bookkeeping on its own (which window pages go, as a function of positions; which cached prefix
is usable), then a tiny Gemma 3 (a 16-token window on its local layer) through the scheduler on the
default bf16 path: the same tokens as with every position kept (--disable-hybrid-swa-memory), each
request holding only its window's pages, prefixes longer than the window reused from the radix
cache, and a window pool too small for the cache's windows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scheduler_harness import Harness
from tiny_models import hf_float32, hf_greedy, make_tiny_model

from mem_cache.window_pages import WindowPages
from srt.sampling_params import SamplingParams

WINDOW = 16  # the tiny Gemma 3's local layer


def pages(num_full: int = 32, num: int = 12, page_size: int = 4, window: int = 6) -> WindowPages:
    return WindowPages(
        num_full_pages=num_full,
        num_pages=num,
        page_size=page_size,
        window=window,
        table_rows=2,
        max_context_len=64,
    )


def grow(wp: WindowPages, table: torch.Tensor, row: int, start: int, end: int) -> None:
    """Positions start .. end-1 of `row` on full page p = position // 4 + 10 * row (page size 4)."""
    slots = torch.arange(start, end) + 40 * row
    table[row, start:end] = slots
    wp.attach(slots)
    wp.write(table, [row], [start], [end])


def test_a_request_keeps_the_window_pages_its_next_token_reads() -> None:
    wp, table = pages(), torch.zeros(2, 64, dtype=torch.int64)
    wp.admit(0, torch.empty(0, dtype=torch.int64))
    grow(wp, table, 0, 0, 22)  # 6 full pages, each with a window page
    assert wp.allocator.num_used_pages == 6 and wp.integrity_error(torch.arange(6, 32)) is None
    wp.slide(table, 0, 22)  # the token at 22 reads 17 .. 22: pages 4 and 5 (positions 16 .. 23)
    assert (wp.page_of[:6] >= 0).tolist() == [False, False, False, False, True, True]
    assert (wp.req_to_token[0, :16] == wp.null_slot).all()
    assert torch.equal(wp.req_to_token[0, 16:22] % 4, torch.arange(16, 22) % 4)
    wp.slide(table, 0, 22)  # again: nothing more
    assert wp.allocator.num_used_pages == 2 and wp.integrity_error(torch.arange(6, 32)) is None


def test_a_cached_prefix_is_usable_up_to_the_window_pages_before_its_end() -> None:
    wp = pages()
    full = torch.arange(40)  # positions 0 .. 39 on full pages 0 .. 9
    wp.attach(full)
    wp.free(torch.tensor([0, 1, 2, 6]))  # slid away (0 .. 2) and a gap (positions 24 .. 27)
    # n = 40 reads 35 ..: pages 8, 9 present. n = 36 reads 31 ..: page 7 present, and so on down to
    # n = 28, which reads 23 ..: page 5 present, page 6 missing.
    assert wp.usable_prefix(full, 40) == 40
    assert wp.usable_prefix(full, 32) == 24  # 32 reads 27 .. 31 (pages 6, 7): 28 reads 23 (page 5, 6)
    assert wp.usable_prefix(full, 20) == 20  # reads 15 .. 19: pages 3, 4
    assert wp.usable_prefix(full, 16) == 0  # 16 reads 11 (page 2): every shorter one too, but 0
    assert wp.usable_prefix(full, 0) == 0


def test_window_pages_no_row_points_at_are_dropped() -> None:
    wp, table = pages(num_full=64), torch.zeros(2, 64, dtype=torch.int64)
    wp.admit(0, torch.empty(0, dtype=torch.int64))
    grow(wp, table, 0, 0, 8)  # row 0: full pages 0, 1
    cached = torch.arange(200, 216)  # full pages 50 .. 53 held by the cache alone
    wp.attach(cached)
    assert wp.allocator.num_used_pages == 6
    assert wp.drop_unreferenced([0]) == 4
    assert (wp.page_of[50:54] == -1).all() and (wp.page_of[:2] >= 0).all()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("gemma3", tmp_path_factory.mktemp("window") / "gemma3")


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 320, (int(torch.randint(20, 70, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def serve(model_dir: Path, batch: list[list[int]], **args: object) -> Harness:
    h = Harness(model_dir, dtype="bfloat16", max_total_tokens=2048, **args)  # type: ignore[arg-type]
    for i, p in enumerate(batch):
        h.submit(f"r{i}", p, GREEDY)
    h.run_until_idle()
    assert h.integrity_error() is None
    return h


@pytest.fixture(scope="module")
def full_pages(gemma3: Path) -> dict[str, list[int]]:
    # the same 8-token chunks as the window runs: outside deterministic mode a prompt's chunking may
    # change its bf16 rounding (on an AVX-512 BF16 CPU it changes these tokens); window pages must not
    return serve(gemma3, prompts(12), disable_hybrid_swa_memory=True, chunked_prefill_size=8).tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_pages_give_the_tokens_of_full_pages(
    gemma3: Path, full_pages: dict[str, list[int]], page_size: int
) -> None:
    """Twelve prompts of 20 to 70 tokens and 24 greedy tokens each, in 8-token chunks, with window
    pages for a quarter of the full pages: the same tokens, and every running request holding at
    most its window's pages (the window, a chunk, and two part pages)."""
    h = Harness(
        gemma3,
        dtype="bfloat16",
        max_total_tokens=2048,
        page_size=page_size,
        chunked_prefill_size=8,
        swa_full_tokens_ratio=0.25,
    )
    window = h.scheduler.kv.window
    assert window is not None and window.num_pages == 2048 // page_size // 4
    for i, p in enumerate(prompts(12)):
        h.submit(f"r{i}", p, GREEDY)
    peak = 0
    for _ in range(10_000):
        h.scheduler.step()
        h._collect()
        live = len(h.scheduler.running) + (h.scheduler.chunked_req is not None)
        if live:
            per_request = window.allocator.num_used_pages - cached_window_pages(h)
            peak = max(peak, per_request / live)
        if not h.scheduler.has_work():
            break
    assert h.tokens == full_pages
    assert h.integrity_error() is None
    assert 0 < peak <= -(-(WINDOW + 8) // page_size) + 2


def cached_window_pages(h: Harness) -> int:
    """Window pages of full pages that only the radix cache holds."""
    window = h.scheduler.kv.window
    assert window is not None
    cached = h.scheduler.tree_cache.all_kv_indices() // window.page_size
    owned = [
        r.own_slots(h.scheduler.kv.req_to_token) // window.page_size
        for r in h.scheduler.running + ([h.scheduler.chunked_req] if h.scheduler.chunked_req else [])
        if r.req_pool_idx is not None
    ]
    only_cached = torch.unique(cached)
    if owned:
        only_cached = only_cached[~torch.isin(only_cached, torch.cat(owned))]
    return int((window.page_of[only_cached] >= 0).sum())


def test_a_prefix_longer_than_the_window_is_reused(gemma3: Path) -> None:
    """A second turn (the first turn's prompt and answer, then more) reuses all of the first turn's
    KV: its last window kept its window pages in the cache. A prompt that leaves the first turn
    part-way reuses only up to where the window pages before it are kept. Both give transformers'
    float32 greedy tokens, as the same prompts alone do."""
    g = torch.Generator().manual_seed(9)
    first = torch.randint(3, 320, (50,), generator=g).tolist()
    h = Harness(gemma3, dtype="float32", max_total_tokens=2048, page_size=4)
    h.submit("t1", first, GREEDY)
    h.run_until_idle()
    answer = h.tokens["t1"]
    second = first + answer + torch.randint(3, 320, (10,), generator=g).tolist()
    branch = first[:40] + torch.randint(3, 320, (10,), generator=g).tolist()
    h.submit("t2", second, GREEDY)
    h.run_until_idle()
    h.submit("b", branch, GREEDY)
    h.run_until_idle()
    # t1 fed 50 + 23 tokens; the cache keeps whole pages (72) and the window pages of the last 16
    assert h.meta["t2"]["cached_tokens"] == 72
    # the branch matches 40 tokens of t1, whose window pages are gone there (t1 slid past them)
    assert h.meta["b"]["cached_tokens"] == 0
    model = hf_float32(gemma3)
    for rid, prompt in (("t1", first), ("t2", second), ("b", branch)):
        assert h.tokens[rid] == hf_greedy(model, prompt, 24), rid
    assert h.integrity_error() is None


def test_a_window_pool_of_two_windows_still_serves_everyone(gemma3: Path) -> None:
    """Window pages for two requests' windows and chunks (the floor): the cache gives up finished
    requests' windows when a new request needs them, and every request gets its full-pages tokens."""
    batch = prompts(12)
    reference = serve(gemma3, batch, disable_hybrid_swa_memory=True, page_size=4, chunked_prefill_size=8)
    h = serve(
        gemma3, batch, page_size=4, chunked_prefill_size=8, swa_full_tokens_ratio=0.03, max_running_requests=2
    )
    assert h.scheduler.kv.window is not None and h.scheduler.kv.window.num_pages == 16  # the floor
    assert h.tokens == reference.tokens


def test_load_counts_the_tokens_requests_hold_not_the_window_pool(gemma3: Path) -> None:
    """/get_load and token_usage with window pages: 0 on an idle server (the window pool, smaller
    than the full one, is no load), and a running request's tokens while it runs."""
    h = Harness(gemma3, dtype="float32", max_total_tokens=2048, page_size=4, swa_full_tokens_ratio=0.25)
    assert h.scheduler.kv.window is not None
    idle = h.scheduler.load_report()
    assert idle == {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}, idle
    assert h.scheduler._load().token_usage == 0.0
    h.submit("r", prompts(1)[0], GREEDY)
    h.scheduler.step()  # its prefill
    busy = h.scheduler.load_report()
    assert busy["num_reqs"] == 1 and 0 < busy["num_tokens"] <= len(prompts(1)[0]) + 24, busy
    h.run_until_idle()
    assert h.scheduler.load_report()["num_tokens"] == 0  # finished: its KV is cache the tree may evict


def test_kv_window_memory_script_prints_both_ways(gemma3: Path) -> None:
    """scripts/kv_window_memory.py on the tiny Gemma 3 (one layer of two within 16 tokens): window
    pages hold less per token than every position, and less the longer the context."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "kv_window_memory.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--model-path",
            str(gemma3),
            "--lengths",
            "64",
            "256",
            "--page-size",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 layers, 1 of them in window pages (window 16 tokens)" in proc.stdout
    rows = re.findall(r"^\s+(\d+) \|\s+(\d+) \|\s+(\d+) \|\s+(\d+) \|\s+([\d.]+)x$", proc.stdout, re.M)
    assert [int(r[0]) for r in rows] == [64, 256], proc.stdout
    ratios = [float(r[4]) for r in rows]
    # every position: 2 layers' K/V; window pages: 1 layer's and a window of the other
    assert 1.0 < ratios[0] < ratios[1] < 2.0, proc.stdout
