"""mem_cache pools: request rows, page allocation and slot layout, KV buffers, budget sizing."""

from __future__ import annotations

import queue
import random
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from mem_cache import (
    KVIntegrityError,
    PageAllocator,
    PagedKVPool,
    ReqToTokenPool,
    kv_bytes_per_token,
    profile_num_pages,
)
from mem_cache.budget import kv_budget
from srt.server_args import ServerArgs
from srt.utils import free_port

# ---------------------------------------------------------------- ReqToTokenPool


def test_req_pool_hands_out_lowest_free_row_and_reports_full() -> None:
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int64
    assert [pool.alloc(), pool.alloc(), pool.alloc()] == [0, 1, 2]
    assert pool.alloc() is None and pool.num_free == 0
    pool.free(2)
    pool.free(0)
    assert pool.num_free == 2
    assert pool.alloc() == 0 and pool.alloc() == 2


def test_req_pool_rejects_double_free_and_bad_index() -> None:
    pool = ReqToTokenPool(size=2, max_context_len=4)
    row = pool.alloc()
    assert row is not None
    pool.free(row)
    with pytest.raises(ValueError, match="double free"):
        pool.free(row)
    with pytest.raises(ValueError, match="idx"):
        pool.free(5)
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="size"):
        ReqToTokenPool(size=0, max_context_len=4)


# ---------------------------------------------------------------- PageAllocator


def test_alloc_extend_page_size_1_prefill_then_decode() -> None:
    alloc = PageAllocator(num_pages=16, page_size=1)
    req_to_token = torch.zeros((4, 10), dtype=torch.int64)
    out = alloc.alloc_extend(req_to_token, [2, 0], [0, 0], [3, 2])
    assert out is not None and out.tolist() == [0, 1, 2, 3, 4]
    assert req_to_token[2, :3].tolist() == [0, 1, 2] and req_to_token[0, :2].tolist() == [3, 4]
    out = alloc.alloc_extend(req_to_token, [2, 0], [3, 2], [4, 3])
    assert out is not None and out.tolist() == [5, 6]
    assert req_to_token[2, :4].tolist() == [0, 1, 2, 5] and req_to_token[0, :3].tolist() == [3, 4, 6]
    assert alloc.num_used_pages == 7 and alloc.num_free_tokens == 9
    alloc.check_integrity(expected_used_pages=7)


def test_decode_step_takes_one_free_page_per_request_in_request_order() -> None:
    """One new token per request on one-token pages (every decode step): request i gets the i-th
    page the free stack hands out, the pages freed last first, written at its own position."""
    alloc = PageAllocator(num_pages=12, page_size=1)
    req_to_token = torch.zeros((4, 10), dtype=torch.int64)
    first = alloc.alloc_extend(req_to_token, [0, 1, 3], [0, 0, 0], [2, 4, 3])
    assert first is not None and first.tolist() == list(range(9))
    alloc.free_slots(req_to_token[1, :4].clone())  # pages 2-5 back on top of the stack
    step = alloc.alloc_extend(req_to_token, [3, 0], [3, 2], [4, 3])
    assert step is not None and step.tolist() == [2, 3]  # the freed pages, before the never-used 9-11
    assert req_to_token[3, :4].tolist() == [6, 7, 8, 2] and req_to_token[0, :3].tolist() == [0, 1, 3]
    step = alloc.alloc_extend(req_to_token, [0, 3, 2], [3, 4, 0], [4, 5, 1])
    assert step is not None and step.tolist() == [4, 5, 9] and req_to_token[2, 0].item() == 9
    step = alloc.alloc_extend(req_to_token, [0, 3], [4, 5], [5, 6])
    assert step is not None and step.tolist() == [10, 11]
    assert alloc.alloc_extend(req_to_token, [0, 3], [5, 6], [6, 7]) is None  # none left
    alloc.check_integrity(expected_used_pages=12)


def test_alloc_extend_page_size_4_continues_partial_pages_and_opens_pages_at_boundaries() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    req_to_token = torch.zeros((2, 16), dtype=torch.int64)
    out = alloc.alloc_extend(req_to_token, [0, 1], [0, 0], [6, 3])
    # A: pages 0, 1 (positions 0..5); B: page 2 (positions 0..2).
    assert out is not None and out.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert alloc.num_used_pages == 3
    steps = [([6, 3], [6, 11]), ([7, 4], [7, 12]), ([8, 5], [16, 13])]  # B opens page 3, then A page 4
    for positions, expected in steps:
        out = alloc.alloc_extend(req_to_token, [0, 1], positions, [p + 1 for p in positions])
        assert out is not None and out.tolist() == expected
    assert req_to_token[0, :9].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 16]
    assert req_to_token[1, :6].tolist() == [8, 9, 10, 11, 12, 13]
    alloc.check_integrity(expected_used_pages=5)


def test_alloc_extend_fills_partial_page_then_fresh_pages_in_one_extend() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    req_to_token = torch.zeros((1, 16), dtype=torch.int64)
    assert alloc.alloc_extend(req_to_token, [0], [0], [6]) is not None  # pages 0, 1
    assert alloc.pages_needed([6], [11]) == 1
    out = alloc.alloc_extend(req_to_token, [0], [6], [11])
    assert out is not None and out.tolist() == [6, 7, 8, 9, 10]
    assert req_to_token[0, :11].tolist() == list(range(11))


def _check_layout(alloc: PageAllocator, req_to_token: torch.Tensor, live: dict[int, int]) -> None:
    """Every live request's slots follow its pages, and no page is shared or also free."""
    ps = alloc.page_size
    owned: list[int] = []
    for row, length in live.items():
        slots = req_to_token[row, :length]
        positions = torch.arange(length)
        assert torch.equal(slots % ps, positions % ps), (row, slots.tolist())
        pages = slots // ps
        for start in range(0, length, ps):
            assert len(set(pages[start : start + ps].tolist())) == 1, (row, slots.tolist())
        owned += pages[::ps].tolist()
    assert len(owned) == len(set(owned)), "a page is owned by two requests"
    alloc.check_integrity(expected_used_pages=len(owned))
    rest = alloc.alloc_pages(alloc.num_free_pages)
    assert rest is not None and not set(rest.tolist()) & set(owned), "an owned page is also free"
    alloc.free_pages(rest)


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_alloc_extend_random_batches_keep_layout_consistent(page_size: int) -> None:
    rng = random.Random(page_size)
    alloc = PageAllocator(num_pages=64 // page_size + 4, page_size=page_size)
    req_pool = ReqToTokenPool(size=6, max_context_len=40)
    live: dict[int, int] = {}
    for _ in range(60):
        if live and rng.random() < 0.25:
            row = rng.choice(sorted(live))
            alloc.free_slots(req_pool.req_to_token[row, : live.pop(row)])
            req_pool.free(row)
        rows = [r for r in sorted(live) if live[r] < 40 and rng.random() < 0.7]
        new_row = req_pool.alloc() if rng.random() < 0.5 else None
        rows += [new_row] if new_row is not None else []
        if new_row is not None:
            live[new_row] = 0
        prefix = [live[r] for r in rows]
        seq = [p + rng.choice([1, 1, rng.randint(1, 40 - p)]) for p in prefix]
        needed = alloc.pages_needed(prefix, seq)
        out = alloc.alloc_extend(req_pool.req_to_token, rows, prefix, seq)
        if out is None:
            assert needed > alloc.num_free_pages
        else:
            assert out.numel() == sum(seq) - sum(prefix)
            expected = torch.cat(
                [req_pool.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq, strict=True)] + [out[:0]]
            )
            assert torch.equal(out, expected)
            live.update(zip(rows, seq, strict=True))
        _check_layout(alloc, req_pool.req_to_token, live)


def test_alloc_extend_is_all_or_nothing_when_pages_run_out() -> None:
    alloc = PageAllocator(num_pages=3, page_size=4)
    req_to_token = torch.full((2, 16), -1, dtype=torch.int64)
    assert alloc.alloc_extend(req_to_token, [0, 1], [0, 0], [9, 4]) is None  # needs 3 + 1 pages
    assert alloc.num_free_pages == 3 and bool((req_to_token == -1).all())
    out = alloc.alloc_extend(req_to_token, [0, 1], [0, 0], [8, 4])
    assert out is not None and alloc.num_free_pages == 0
    assert alloc.alloc_pages(1) is None


def test_alloc_extend_rejects_inconsistent_arguments() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    req_to_token = torch.zeros((2, 8), dtype=torch.int64)
    with pytest.raises(ValueError, match="prefix_lens"):
        alloc.alloc_extend(req_to_token, [0], [3], [2])
    with pytest.raises(ValueError, match="max context"):
        alloc.alloc_extend(req_to_token, [0], [0], [9])
    with pytest.raises(ValueError, match="req_pool_indices"):
        alloc.alloc_extend(req_to_token, [2], [0], [1])
    assert alloc.num_free_pages == 4


def test_decode_step_costs_the_same_tensor_ops_for_8_and_64_requests() -> None:
    class OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for bs in (8, 64):
        alloc = PageAllocator(num_pages=1024, page_size=4)
        req_to_token = torch.zeros((bs, 64), dtype=torch.int64)
        rows = list(range(bs))
        assert alloc.alloc_extend(req_to_token, rows, [0] * bs, [5] * bs) is not None
        with OpCounter() as counter:
            assert alloc.alloc_extend(req_to_token, rows, [5] * bs, [6] * bs) is not None
        counts.append(counter.count)
    assert counts[0] == counts[1] < 40, counts


def test_free_rejects_double_free_out_of_range_and_repeats_without_freeing_anything() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    pages = alloc.alloc_pages(3)
    assert pages is not None and pages.tolist() == [0, 1, 2]
    alloc.free_pages(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free_pages(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="pages must be in"):
        alloc.free_pages(torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="repeated"):
        alloc.free_pages(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="double free"):
        alloc.free_slots(torch.tensor([0, 1]))  # page 0
    assert alloc.num_free_pages == 2
    alloc.check_integrity(expected_used_pages=2)
    alloc.free_slots(torch.tensor([2, 3, 5]))  # pages 1, 2
    assert alloc.num_free_pages == 4 and alloc.num_used_pages == 0


def test_freed_pages_come_back_last_freed_first() -> None:
    """LIFO: the pages freed last (still resident on CPU) go out before pages freed long ago or
    never touched, so the pool's touched memory follows the working set."""
    alloc = PageAllocator(num_pages=8, page_size=1)
    assert alloc.alloc_pages(4) is not None  # 0-3
    alloc.free_pages(torch.tensor([3]))
    alloc.free_pages(torch.tensor([1, 2]))
    again = alloc.alloc_pages(3)
    assert again is not None and again.tolist() == [1, 2, 3]  # the last free first, each batch in its order
    assert alloc.free_page_ids().tolist() == [7, 6, 5, 4]  # the longest-free (never used) first
    alloc.reset()
    assert alloc.num_free_pages == 8 and alloc.num_used_pages == 0
    alloc.check_integrity(expected_used_pages=0)


def test_churn_touches_only_the_working_set() -> None:
    """Requests of 8 pages come and go one at a time (each finished one freed, as an eviction
    would): with LIFO they never leave the first 16 pages of a pool of 1000; a free list handed
    out in order would have swept all 1000."""
    alloc = PageAllocator(num_pages=1000, page_size=1)
    touched: set[int] = set()
    held = [alloc.alloc_pages(8)]
    for _ in range(500):
        pages = alloc.alloc_pages(8)
        assert pages is not None
        touched.update(pages.tolist())
        held.append(pages)
        old = held.pop(0)
        assert old is not None
        alloc.free_pages(old)
    assert max(touched) < 16
    alloc.check_integrity(expected_used_pages=8)


def test_check_integrity_detects_corruption_with_numbers() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    assert alloc.alloc_pages(2) is not None
    alloc.check_integrity(expected_used_pages=2)
    with pytest.raises(KVIntegrityError, match="used 2 != expected 3"):
        alloc.check_integrity(expected_used_pages=3)
    alloc._stack[alloc._top] = alloc._stack[0]  # corrupt: a page twice on the free stack
    alloc._top += 1
    with pytest.raises(KVIntegrityError, match=r"duplicate.*total 4, free 3, used 2"):
        alloc.check_integrity()
    alloc.reset()
    alloc._stack[0] = 7  # corrupt: out of range
    with pytest.raises(KVIntegrityError, match="outside"):
        alloc.check_integrity()


# ---------------------------------------------------------------- PagedKVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kv_pool_set_get_round_trip_casts_and_touches_only_given_slots(dtype: torch.dtype) -> None:
    pool = PagedKVPool(num_pages=3, page_size=2, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype)
    assert pool.num_slots == 6 and pool.bytes_per_token == 2 * 2 * 2 * 4 * dtype.itemsize
    assert pool.total_bytes == 6 * pool.bytes_per_token
    for layer in range(2):
        k_buf, v_buf = pool.get_kv_buffer(layer)
        k_buf.copy_(torch.zeros(6, 2, 4))
        v_buf.copy_(torch.zeros(6, 2, 4))
    loc = torch.tensor([5, 0, 3])
    k = torch.tensor([1.0, 2.0, 0.5]).view(3, 1, 1).expand(3, 2, 4)
    pool.set_kv_buffer(1, loc, k, -k)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.dtype == dtype and k_buf.shape == (6, 2, 4)
    assert torch.equal(k_buf[loc].float(), k) and torch.equal(v_buf[loc].float(), -k)
    assert not bool(k_buf[[1, 2, 4]].float().any()), "other slots changed"
    assert not bool(pool.get_kv_buffer(0)[0].float().any()), "other layer changed"
    with pytest.raises(ValueError, match="layer_id"):
        pool.get_kv_buffer(2)


# ---------------------------------------------------------------- budget

GIB = 1 << 30


def test_kv_bytes_per_token_counts_k_and_v_over_layers() -> None:
    assert kv_bytes_per_token(num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16) == 114688
    with pytest.raises(ValueError, match="head_dim"):
        kv_bytes_per_token(num_layers=1, num_kv_heads=1, head_dim=0, dtype=torch.float16)


def test_profile_num_pages_formula_sharing_and_cap() -> None:
    common: dict[str, Any] = dict(device="cpu", bytes_per_token=1024, page_size=16, total_memory=100 * GIB)
    # 40 GiB free - 100 GiB * 0.1 reserved = 30 GiB for KV; 16 KiB per page.
    assert profile_num_pages(mem_fraction_static=0.9, free_memory=40 * GIB, **common) == 30 * GIB // (
        16 * 1024
    )
    shared = profile_num_pages(mem_fraction_static=0.9, free_memory=40 * GIB, local_world_size=4, **common)
    assert shared == 30 * GIB // 4 // (16 * 1024)
    capped = profile_num_pages(mem_fraction_static=0.9, free_memory=40 * GIB, max_total_tokens=1000, **common)
    assert capped == 1000 // 16


def test_profile_num_pages_too_small_names_flags_and_bytes() -> None:
    with pytest.raises(ValueError) as info:
        profile_num_pages(
            device="cpu",
            mem_fraction_static=0.5,
            bytes_per_token=2048,
            page_size=1,
            free_memory=10 * GIB,
            total_memory=20 * GIB,
        )  # 10 GiB free, 10 GiB reserved
    message = str(info.value)
    for needle in ("--mem-fraction-static", "--max-total-tokens", str(10 * GIB), "2048 B per token"):
        assert needle in message, (needle, message)
    with pytest.raises(ValueError, match="need at least 5"):
        profile_num_pages(
            device="cpu",
            mem_fraction_static=0.9,
            bytes_per_token=1,
            page_size=4,
            max_total_tokens=16,
            free_memory=GIB,
            total_memory=GIB,
            min_pages=5,
        )
    with pytest.raises(ValueError, match="mem_fraction_static"):
        profile_num_pages(device="cpu", mem_fraction_static=1.5, bytes_per_token=1, page_size=1)


def test_cpu_budget_is_the_smaller_of_the_space_and_what_running_requests_can_hold() -> None:
    # SmolLM2-135M in bf16: 23040 B a token; a 24 GiB host with 20 GiB available
    host: dict[str, Any] = dict(
        device="cpu",
        bytes_per_token=23040,
        page_size=1,
        free_memory=20 * GIB,
        total_memory=24 * GIB,
        max_running_requests=128,
        context_length=8192,
    )
    default = kv_budget(**host)
    assert default.num_tokens == 4 * GIB // 23040 == 186413  # not 0.8 of the host (about 660k tokens)
    assert default.flag == "--cpu-kvcache-space" and "4 GiB (the default)" in default.bound
    line = default.describe()
    assert (
        line.startswith("KV cache budget: 4 GiB = 186413 tokens")
        and "change it with --cpu-kvcache-space" in line
    )
    small = kv_budget(**host, cpu_kvcache_space=0.25)
    assert small.num_tokens == GIB // 4 // 23040 and "--cpu-kvcache-space 0.25 GiB" in small.bound
    few = kv_budget(**{**host, "max_running_requests": 4, "context_length": 2048})
    assert few.num_tokens == 4 * 2048 and few.flag == "--max-running-requests or --context-length"
    paged = kv_budget(**{**host, "page_size": 16, "max_running_requests": 2, "context_length": 100})
    assert paged.num_pages == 2 * 7  # each request's 100 tokens on 7 pages of 16
    tp = kv_budget(**host, local_world_size=2)  # two ranks of the host share the space
    assert tp.num_pages == 4 * GIB // 2 // 23040 and "/ 2 local ranks" in tp.bound
    assert "2 ranks on this host" in tp.describe()


def test_cpu_budget_keeps_sglangs_flags_when_given() -> None:
    host: dict[str, Any] = dict(
        device="cpu",
        bytes_per_token=1024,
        page_size=1,
        free_memory=20 * GIB,
        total_memory=24 * GIB,
        max_running_requests=128,
        context_length=8192,
    )
    fraction = kv_budget(**host, mem_fraction_static=0.9)  # 20 - 2.4 GiB, no space bound
    assert fraction.num_bytes == int(20 * GIB - int(24 * GIB * 0.1)) // 1024 * 1024
    assert fraction.flag == "--mem-fraction-static"
    tokens = kv_budget(**host, max_total_tokens=10_000_000)  # more than 4 GiB / 1 KiB: it wins anyway
    assert tokens.num_tokens == 10_000_000 and tokens.flag == "--max-total-tokens"
    both = kv_budget(**host, max_total_tokens=10_000_000, cpu_kvcache_space=1.0)  # given too: it applies
    assert both.num_tokens == GIB // 1024 and both.flag == "--cpu-kvcache-space"
    short = kv_budget(**{**host, "free_memory": 5 * GIB})  # the host has less than the space: it bounds
    assert short.flag == "--mem-fraction-static" and "host RAM" in short.bound
    cuda = kv_budget(**{**host, "device": "cuda"})  # GPU semantics: 0.8 of the device
    assert cuda.num_bytes == int(20 * GIB - int(24 * GIB * (1 - 0.8))) // 1024 * 1024
    with pytest.raises(ValueError, match="cpu-kvcache-space"):
        kv_budget(**host, cpu_kvcache_space=0)


def test_dp_replicas_split_the_hosts_kv_space() -> None:
    assert ServerArgs(dp_size=2).replica_memory_share(2) == {"cpu_kvcache_space": 2.0}
    assert ServerArgs(dp_size=4, cpu_kvcache_space=1.0).replica_memory_share(4) == {"cpu_kvcache_space": 0.25}
    assert ServerArgs(dp_size=2, mem_fraction_static=0.6).replica_memory_share(2) == {
        "mem_fraction_static": 0.3
    }
    assert ServerArgs(dp_size=2, max_total_tokens=4096).replica_memory_share(2) == {}  # tokens per replica


def _budget_worker(rank: int, port: int, results: Any) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=30),
        )
        group = dist.new_group(backend="gloo")
        common: dict[str, Any] = dict(
            device="cpu",
            mem_fraction_static=0.9,
            bytes_per_token=1024,
            page_size=1,
            total_memory=10 * GIB,
            cpu_group=group,
        )
        pages = profile_num_pages(free_memory=(2 + 3 * rank) * GIB, **common)
        try:  # rank 1 alone is short of memory: both must raise, neither may hang
            profile_num_pages(free_memory=2 * GIB if rank == 0 else GIB // 2, **common)
            raised = "no error"
        except ValueError as error:
            raised = str(error)
        results.put((rank, pages, raised))
        dist.destroy_process_group()
    except BaseException as error:  # report instead of leaving the parent waiting
        results.put((rank, None, repr(error)))


def test_profile_num_pages_all_reduces_the_minimum_over_ranks() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_budget_worker, args=(rank, port, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = {}
        for _ in range(2):
            rank, pages, raised = results.get(timeout=120)
            got[rank] = (pages, raised)
    except queue.Empty:
        pytest.fail("a rank did not report within 120 s")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    # Rank 0 has 2 GiB free - 1 GiB reserved = 1 GiB; rank 1 has 4 GiB: both get rank 0's count.
    assert got[0][0] == got[1][0] == GIB // 1024, got
    assert all("KV cache too small: 0 page(s)" in got[rank][1] for rank in (0, 1)), got
