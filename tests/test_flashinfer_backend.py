"""The CUDA attention path on a CPU machine: flashinfer's page table (paged_kv_metadata), which
backend --attention-backend auto picks, the start-up warning of unverified GPU paths. The kernels
themselves run only on CUDA with flashinfer installed (the last test)."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mem_cache.allocator import PageAllocator
from mem_cache.kv_pool import PagedKVPool
from model_executor.attention import registry
from model_executor.attention.flashinfer_backend import paged_kv_metadata, qo_indptr
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.gpu_status import GPU_VERIFIED, gpu_paths_in_use, warn_unverified_gpu_paths
from model_executor.layers.attention import Attention

ROOT = Path(__file__).resolve().parent.parent
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def metadata(
    req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], page_size: int
) -> list[list[int]]:
    out = paged_kv_metadata(req_to_token, torch.tensor(rows), torch.tensor(seq_lens), page_size)
    assert all(t.dtype == torch.int32 for t in out)
    return [t.tolist() for t in out]


def test_page_size_1_every_slot_is_a_page() -> None:
    req_to_token = torch.zeros(4, 8, dtype=torch.int64)
    req_to_token[2, :3] = torch.tensor([7, 0, 5])
    req_to_token[0, :1] = torch.tensor([3])
    assert metadata(req_to_token, [2, 0], [3, 1], 1) == [[0, 3, 4], [7, 0, 5, 3], [1, 1]]


def test_page_size_4_shuffled_pages_and_partial_last_pages() -> None:
    req_to_token = torch.zeros(3, 16, dtype=torch.int64)
    # row 1: pages 7, 2, 11 (10 tokens: the last page holds 2); row 0: page 5, full (4 tokens);
    # row 2: page 0 (1 token)
    req_to_token[1, :10] = torch.tensor([28, 29, 30, 31, 8, 9, 10, 11, 44, 45])
    req_to_token[0, :4] = torch.tensor([20, 21, 22, 23])
    req_to_token[2, :1] = torch.tensor([0])
    assert metadata(req_to_token, [1, 0, 2], [10, 4, 1], 4) == [[0, 3, 4, 5], [7, 2, 11, 5, 0], [2, 4, 1]]


def test_a_prefix_ending_mid_page_continues_its_page() -> None:
    """What the allocator hands out: a chunked prefill whose first chunk ends mid-page, then a
    decode step that crosses into a new page."""
    allocator = PageAllocator(num_pages=16, page_size=4)
    allocator.alloc_pages(3)  # the next pages are not 0, 1, 2
    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    allocator.alloc_extend(req_to_token, [1, 0], [0, 0], [6, 3])
    allocator.alloc_extend(req_to_token, [1, 0], [6, 3], [11, 4])  # row 1: 6 -> 11, mid-page
    allocator.alloc_extend(req_to_token, [1, 0], [11, 4], [12, 5])  # row 0 opens a page
    pages_1 = (req_to_token[1, :12:4] // 4).tolist()
    pages_0 = (req_to_token[0, :5:4] // 4).tolist()
    for row, n in ((1, 12), (0, 5)):  # position p at offset p % 4 of its page
        assert (req_to_token[row, :n] % 4).tolist() == [p % 4 for p in range(n)]
    assert metadata(req_to_token, [1, 0], [12, 5], 4) == [[0, 3, 5], pages_1 + pages_0, [4, 1]]
    assert metadata(req_to_token, [1], [11], 4) == [[0, 3], pages_1, [3]]


def test_qo_indptr_and_refusals() -> None:
    assert qo_indptr(torch.tensor([3, 1, 5])).tolist() == [0, 3, 4, 9]
    assert qo_indptr(torch.tensor([3, 1])).dtype == torch.int32
    req_to_token = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        paged_kv_metadata(req_to_token, torch.tensor([0]), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        paged_kv_metadata(req_to_token, torch.tensor([0]), torch.tensor([0]), 1)


@pytest.mark.parametrize(
    ("importable", "registered", "expected"),
    [
        ({"flashinfer", "triton"}, True, "flashinfer"),
        ({"triton"}, True, "triton"),
        ({"triton"}, False, "torch_native"),  # no triton backend in this tree
        (set(), True, "torch_native"),
    ],
)
def test_auto_on_cuda(
    monkeypatch: pytest.MonkeyPatch, importable: set[str], registered: bool, expected: str
) -> None:
    monkeypatch.setattr(registry, "_importable", lambda module: module in importable)
    if registered:
        monkeypatch.setitem(
            registry.ATTENTION_BACKENDS, "triton", registry.ATTENTION_BACKENDS["torch_native"]
        )
    else:
        monkeypatch.delitem(registry.ATTENTION_BACKENDS, "triton", raising=False)
    assert registry.default_attention_backend(CUDA) == expected
    assert registry.resolve_attention_backend("auto", CUDA) == expected
    assert registry.default_attention_backend(CPU) == "cpu_kernels"
    assert registry.resolve_attention_backend("torch_native", CUDA) == "torch_native"


def test_a_broken_install_is_absent_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="srt.attention"):
        assert not registry._importable("srt_no_such_module")
    assert "srt_no_such_module not usable here" in caplog.text
    assert registry._importable("json")


def test_the_cpu_path_never_imports_flashinfer(tmp_path: Path) -> None:
    """A flashinfer that breaks on import, first on the path: the CPU path's modules import as usual."""
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise RuntimeError('flashinfer imported')\n")
    code = (
        "import sys, torch\n"
        "import model_executor.model_runner, model_executor.attention.flashinfer_backend\n"
        "from model_executor.attention.registry import resolve_attention_backend\n"
        "assert resolve_attention_backend('auto', torch.device('cpu')) == 'cpu_kernels'\n"
        "assert 'flashinfer' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_unverified_gpu_paths_warn_on_cuda_only(caplog: pytest.LogCaptureFixture) -> None:
    assert set(GPU_VERIFIED) == {"flashinfer", "triton", "cuda_graph", "nccl"}
    assert gpu_paths_in_use(CUDA, "flashinfer", world_size=2) == ["flashinfer", "nccl"]
    assert gpu_paths_in_use(CUDA, "torch_native", world_size=1) == []
    assert gpu_paths_in_use(CPU, "flashinfer", world_size=2) == []
    with caplog.at_level(logging.WARNING, logger="srt.gpu_status"):
        assert warn_unverified_gpu_paths(CPU, ["triton"]) == []
        assert caplog.records == []
        assert warn_unverified_gpu_paths(CUDA, ["triton", "nccl"]) == ["triton", "nccl"]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    assert messages[0].startswith("the triton path has not been verified on a GPU yet (see docs/")
    assert messages[1].startswith("the nccl path has not been verified on a GPU yet")
    with pytest.raises(ValueError, match="unknown GPU paths"):
        warn_unverified_gpu_paths(CUDA, ["flashinfr"])


def test_a_verified_path_does_not_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(GPU_VERIFIED, "triton", "2026-01-01 docs/benchmarks/triton_h200.md")
    with caplog.at_level(logging.WARNING, logger="srt.gpu_status"):
        assert warn_unverified_gpu_paths(CUDA, ["triton", "flashinfer"]) == []
    assert caplog.records == []


def test_each_verified_path_names_a_committed_run() -> None:
    root = Path(__file__).resolve().parent.parent
    for path, run in GPU_VERIFIED.items():
        if run is not None:
            date, record = run.split(" ", 1)
            assert (root / record).is_file() and date in record, (path, run)


def run_steps(
    backend_name: str, page_size: int, kv_heads: int, steps: list[tuple[ForwardMode, list[int], list[int]]]
) -> list[torch.Tensor]:
    """Runs the same steps (mode, prefix_lens, seq_lens of requests in rows 0..bs-1) on a fresh
    pool with the named backend; returns each step's attention output."""
    torch.manual_seed(0)
    heads, head_dim, dtype = 8, 64, torch.bfloat16
    pool = PagedKVPool(256, page_size, 1, kv_heads, head_dim, dtype, CUDA)
    allocator = PageAllocator(256, page_size, device=CUDA)
    allocator.alloc_pages(5)  # later pages are not in row order
    req_to_token = torch.zeros(4, 256, dtype=torch.int64, device=CUDA)
    backend = registry.create_attention_backend(backend_name, CUDA, pool, req_to_token, False)
    layer = Attention(0, heads, kv_heads, head_dim, head_dim**-0.5)
    outputs = []
    for mode, prefix_lens, seq_lens in steps:
        rows = list(range(len(seq_lens)))
        loc = allocator.alloc_extend(req_to_token, rows, prefix_lens, seq_lens)
        assert loc is not None
        n = sum(s - p for p, s in zip(prefix_lens, seq_lens))
        batch = make_forward_batch(mode, [0] * n, rows, prefix_lens, seq_lens, loc, CUDA)
        batch.attn_backend = backend
        backend.init_forward_metadata(batch)
        q = torch.randn(n, heads * head_dim, dtype=dtype, device=CUDA)
        k = torch.randn(n, kv_heads * head_dim, dtype=dtype, device=CUDA)
        v = torch.randn(n, kv_heads * head_dim, dtype=dtype, device=CUDA)
        outputs.append(backend.forward(q, k, v, layer, batch).float())
    return outputs


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer's kernels run on CUDA with flashinfer installed",
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_heads", [8, 2])  # MHA, GQA (4 query heads per KV head)
def test_flashinfer_matches_torch_native(page_size: int, kv_heads: int) -> None:
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    steps = [
        (extend, [0, 0, 0], [5, 17, 40]),  # fresh prompts
        (decode, [5, 17, 40], [6, 18, 41]),
        (extend, [6, 18, 41], [9, 30, 42]),  # over a cached prefix (chunked prefill), mid-page
        (decode, [9, 30, 42], [10, 31, 43]),
    ]
    expected = run_steps("torch_native", page_size, kv_heads, steps)
    got = run_steps("flashinfer", page_size, kv_heads, steps)
    for (mode, _, _), want, out in zip(steps, expected, got):
        assert out.shape == want.shape
        assert (out - want).abs().max().item() < 2e-2, mode


def test_auto_on_cuda_skips_flashinfer_for_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer has no float32 kernels (a float32 prefill failed on the H200, 2026-12-04): auto
    takes triton there, and the backend itself refuses a float32 pool by name."""
    monkeypatch.setattr(registry, "_importable", lambda module: True)
    assert registry.default_attention_backend(CUDA, torch.bfloat16) == "flashinfer"
    assert registry.default_attention_backend(CUDA, torch.float32) == "triton"
    assert registry.resolve_attention_backend("auto", CUDA, torch.float32) == "triton"
