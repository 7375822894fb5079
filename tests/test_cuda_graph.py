"""CUDA graphs for decode (model_executor/cuda/), on the CPU: the batch sizes captured, the padding,
the flags, and the runner's bookkeeping with an eager stand-in for capture and replay. What only a
GPU shows (the real capture, no host sync in a replay) is checked on one elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mem_cache.allocator import PageAllocator
from mem_cache.budget import KVBudget, kv_budget
from mem_cache.kv_memory import KVMemory
from mem_cache.kv_pool import PagedKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool
from model_executor.attention.torch_native import TorchNativeAttnBackend
from model_executor.cuda.graph_plan import GraphPlan, Padding, capture_sizes, default_capture_sizes
from model_executor.cuda.graph_runner import CudaGraphRunner, declines_all
from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner, RunnerConfig
from srt.server_args import ServerArgs

PROMPTS = [[5, 9, 2], [7, 1, 4, 8, 3, 6, 2], [11], [3, 3, 5, 9, 12], [2, 4, 6, 8, 10, 12, 14, 16, 18]]


def test_default_sizes_are_sglangs() -> None:
    sizes = default_capture_sizes(256)
    assert sizes[:7] == [1, 2, 4, 8, 12, 16, 24] and sizes[-1] == 256
    assert default_capture_sizes(600)[-3:] == [544, 576, 600]  # steps of 32 past 512, the max itself last
    assert capture_sizes(None, None, 128)[-1] == 128  # auto: the max running requests
    assert capture_sizes(None, None, 1000)[-1] == 256  # at most 256
    assert capture_sizes(64, None, 20) == [1, 2, 4, 8, 12, 16, 20]  # capped by the running requests
    assert capture_sizes(None, (8, 1, 3, 3), 4) == [1, 3, 4]
    with pytest.raises(ValueError, match="--cuda-graph-bs"):
        capture_sizes(None, (0, 2), 8)


def test_bucket_and_padding() -> None:
    plan = GraphPlan((1, 2, 4, 8), Padding(req_pool_index=9, out_cache_loc=64))
    assert [plan.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert plan.padded([17, 3, 40], 4, "seq_len") == [17, 3, 40, 1]
    assert plan.padded([30], 2, "out_cache_loc") == [30, 64]
    assert not plan.still_valid((("kv", 1),))  # nothing captured yet
    plan.record((("kv", 1),))
    assert plan.still_valid((("kv", 1),)) and not plan.still_valid((("kv", 2),))


def test_flags() -> None:
    assert ServerArgs(device="cpu", disable_cuda_graph=True).disable_cuda_graph  # accepted everywhere
    for field, value, flag in (
        ("cuda_graph_max_bs", 8, "--cuda-graph-max-bs"),
        ("cuda_graph_bs", (1, 2), "--cuda-graph-bs"),
    ):
        with pytest.raises(ValueError, match=f"{flag} .*--device cuda only"):
            ServerArgs(device="cpu", **{field: value})
    assert ServerArgs(device="cuda", cuda_graph_bs=(1, 2)).to_cli() == [
        "--device",
        "cuda",
        "--cuda-graph-bs",
        "1",
        "2",
    ]
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be positive"):
        ServerArgs(device="cuda", cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="--cuda-graph-bs must be"):
        ServerArgs(device="cuda", cuda_graph_bs=(4, 0))


def test_padding_page_and_row_only_when_asked() -> None:
    plain = PagedKVPool(16, 4, 2, 2, 8, torch.float32)
    padded = PagedKVPool(16, 4, 2, 2, 8, torch.float32, padding_page=True)
    assert plain.padding_slot is None and plain.total_bytes == plain.bytes_per_token * 64
    assert padded.padding_slot == 64 and padded.total_bytes == plain.total_bytes + 4 * plain.bytes_per_token
    rows = ReqToTokenPool(4, 32, padding_row=True)
    assert rows.padding_row == 4 and rows.req_to_token.shape[0] == 5
    assert sorted(rows.alloc() for _ in range(4)) == [0, 1, 2, 3] and rows.alloc() is None
    assert ReqToTokenPool(4, 32).req_to_token.shape[0] == 4

    def budget(padding_pages: int) -> int:
        return kv_budget(
            device="cuda",
            bytes_per_token=16,
            page_size=1,
            free_memory=10_000,
            total_memory=10_000,
            padding_pages=padding_pages,
        ).num_pages

    assert budget(1) == budget(0) - 1  # the padding page comes out of the memory budget


class CaptureSafeForTest(TorchNativeAttnBackend):
    """torch_native reads seq_lens_cpu in init_forward_metadata; the eager stand-in below re-runs it
    every replay with the step's padded lists, so here that is safe."""

    supports_cuda_graph = True


class _Eager:
    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


class EagerCapture:
    def capture(self, fn: Callable[[], torch.Tensor]) -> _Eager:
        fn()  # the warm-up, as the real capture runs it
        return _Eager(fn)


@pytest.fixture(scope="module")
def graphed(tiny_model_dirs: dict[str, Path]) -> tuple[ModelRunner, CudaGraphRunner, KVMemory]:
    runner = ModelRunner(
        RunnerConfig(
            model_dir=tiny_model_dirs["llama"],
            dtype=torch.float32,
            max_total_tokens=256,
            max_running_requests=8,
            attention_backend="torch_native",
        )
    )
    layers, heads, dim = runner.model.kv_cache_layout()
    pool = PagedKVPool(64, 4, layers, heads, dim, torch.float32, padding_page=True)
    memory = KVMemory(
        ReqToTokenPool(8, 64, padding_row=True),
        pool,
        PageAllocator(64, 4),
        KVBudget(64, 4, pool.bytes_per_token, "test", "--max-total-tokens"),
    )
    backend = CaptureSafeForTest(pool, memory.req_to_token_pool.req_to_token)
    graphs = CudaGraphRunner(
        runner.model, backend, memory, [1, 2, 4, 8], device=torch.device("cpu"), graphs=EagerCapture()
    )
    graphs.prepare()
    return runner, graphs, memory


def eager(runner: ModelRunner, graphs: CudaGraphRunner, batch: ForwardBatch) -> torch.Tensor:
    batch.attn_backend = graphs.attn_backend
    graphs.attn_backend.init_forward_metadata(batch)
    out = runner.model(batch.input_ids, batch.positions, batch, None)
    assert isinstance(out, torch.Tensor)
    return out


@torch.inference_mode()
def test_padded_replay_equals_eager_and_spares_other_kv(
    graphed: tuple[ModelRunner, CudaGraphRunner, KVMemory],
) -> None:
    runner, graphs, memory = graphed
    assert graphs.captured == [1, 2, 4, 8]
    table = memory.req_to_token_pool.req_to_token
    rows = [memory.req_to_token_pool.alloc() for _ in PROMPTS]
    assert None not in rows
    lens = [len(p) for p in PROMPTS]
    loc = memory.allocator.alloc_extend(table, rows, [0] * len(rows), lens)  # type: ignore[arg-type]
    eager(runner, graphs, make_forward_batch(ForwardMode.EXTEND, sum(PROMPTS, []), rows, [0] * 5, lens, loc))  # type: ignore[arg-type]
    k0, v0 = memory.kv_pool.get_kv_buffer(0)
    for bs in (1, 3, 5):  # replay sizes 1, 4, 8
        prefixes, seqs = lens[:bs], [n + 1 for n in lens[:bs]]
        new = memory.allocator.alloc_extend(table, rows[:bs], prefixes, seqs)  # type: ignore[arg-type]
        assert new is not None
        batch = make_forward_batch(
            ForwardMode.DECODE, [20 + i for i in range(bs)], rows[:bs], prefixes, seqs, new
        )  # type: ignore[arg-type]
        held = torch.cat([table[r, :n] for r, n in zip(rows, lens)])  # every request's KV before this step
        before = k0[held].clone(), v0[held].clone()
        assert graphs.can_run(batch)
        replayed = graphs.run(batch)
        assert isinstance(replayed, torch.Tensor) and replayed.shape[0] == bs
        replayed = replayed.clone()
        assert torch.equal(k0[held], before[0]) and torch.equal(v0[held], before[1])
        torch.testing.assert_close(replayed, eager(runner, graphs, batch), rtol=1e-5, atol=1e-5)
        lens[:bs] = seqs
    assert not graphs.can_run(
        make_forward_batch(
            ForwardMode.DECODE, [1] * 9, [0] * 9, [1] * 9, [2] * 9, torch.zeros(9, dtype=torch.int64)
        )
    )


def test_declines(graphed: tuple[ModelRunner, CudaGraphRunner, KVMemory]) -> None:
    runner, graphs, memory = graphed
    extend = make_forward_batch(ForwardMode.EXTEND, [1, 2], [0], [0], [2], torch.tensor([0, 1]))
    assert not graphs.can_run(extend)
    plain = TorchNativeAttnBackend(memory.kv_pool, memory.req_to_token_pool.req_to_token)
    assert "reads host values" in str(declines_all(runner.model, plain, tp_size=1, pp_size=1))
    assert "--pp-size" in str(declines_all(runner.model, graphs.attn_backend, tp_size=1, pp_size=2))
    decode = make_forward_batch(ForwardMode.DECODE, [1], [0], [1], [2], torch.tensor([3]))
    assert graphs.can_run(decode)
    kept = memory.kv_pool.k_buffer[0]
    memory.kv_pool.k_buffer[0] = kept.clone()  # the pool reallocated: the graphs address the old one
    try:
        assert not graphs.can_run(decode)
    finally:
        memory.kv_pool.k_buffer[0] = kept
    assert graphs.can_run(decode)


class FailingCapture:
    def capture(self, fn: Callable[[], torch.Tensor]) -> _Eager:
        raise RuntimeError("operation not permitted when stream is capturing")


@torch.inference_mode()
def test_a_failed_capture_decodes_eagerly_and_says_why(
    graphed: tuple[ModelRunner, CudaGraphRunner, KVMemory], caplog: pytest.LogCaptureFixture
) -> None:
    runner, graphs, memory = graphed
    failing = CudaGraphRunner(
        runner.model, graphs.attn_backend, memory, [1, 2], device=torch.device("cpu"), graphs=FailingCapture()
    )
    with caplog.at_level("ERROR", logger="srt.cuda_graph"):
        failing.prepare()
    assert failing.captured == [] and "stream is capturing" in str(failing.declined)
    assert "without CUDA graphs" in caplog.text
    decode = make_forward_batch(ForwardMode.DECODE, [1], [0], [1], [2], torch.tensor([3]))
    assert not failing.can_run(decode)


@torch.inference_mode()
def test_consecutive_replays_of_one_size_each_see_their_own_positions(
    graphed: tuple[ModelRunner, CudaGraphRunner, KVMemory],
) -> None:
    """Two decode steps of one request replayed back to back: the static positions tensor is the same
    object with new values, so nothing may be cached by its identity (the rotary tables were, and a
    real capture recorded the warm-up's position-0 rows into every graph)."""
    runner, graphs, memory = graphed
    memory.reset()
    table = memory.req_to_token_pool.req_to_token
    row = memory.req_to_token_pool.alloc()
    assert row is not None
    prompt = PROMPTS[1]
    loc = memory.allocator.alloc_extend(table, [row], [0], [len(prompt)])
    eager(runner, graphs, make_forward_batch(ForwardMode.EXTEND, prompt, [row], [0], [len(prompt)], loc))  # type: ignore[arg-type]
    steps = []
    for i in range(2):
        n = len(prompt) + i
        new = memory.allocator.alloc_extend(table, [row], [n], [n + 1])
        steps.append(make_forward_batch(ForwardMode.DECODE, [30 + i], [row], [n], [n + 1], new))  # type: ignore[arg-type]
        replayed = graphs.run(steps[-1])
        assert isinstance(replayed, torch.Tensor)
        steps[-1].replayed = replayed.clone()  # type: ignore[attr-defined]
    for batch in steps:
        torch.testing.assert_close(batch.replayed, eager(runner, graphs, batch), rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]
