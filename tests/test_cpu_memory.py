"""A rank process keeps freed activation memory in its heap instead of unmapping it, and oneDNN's
per-shape caches stay bounded however many shapes its matmuls see."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from model_executor.cpu.memory import ONEDNN_CACHE_SHAPES, bound_onednn_caches

PROBE = """
import sys, psutil, torch
from model_executor.cpu.memory import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
proc = psutil.Process()
x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
before = proc.memory_info().rss
del x
print((before - proc.memory_info().rss) // 2**20)
"""


def released_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_tensors_stay_in_the_heap_only_when_tuned() -> None:
    assert released_mib("default") >= 60  # glibc unmaps a block this large on free
    assert released_mib("tuned") < 4


# bf16 matmuls of 400 row counts (a prefill's rows are its step's tokens): the heap's bytes in use after
CACHE_PROBE = """
import ctypes, sys, torch, torch.nn.functional as F
from model_executor.cpu.memory import bound_onednn_caches
if sys.argv[1] == "bounded":
    bound_onednn_caches()
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
weight = torch.randn(256, 256, dtype=torch.bfloat16)
F.linear(torch.randn(1, 256, dtype=torch.bfloat16), weight)
before = libc.mallinfo2().uordblks
for rows in range(2, 402):
    F.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
print((libc.mallinfo2().uordblks - before) // 2**20)
"""


def held_mib(mode: str) -> int:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, mode], capture_output=True, text=True, check=True, env=env
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="glibc mallinfo2; oneDNN bf16 matmuls",
)
def test_onednn_keeps_a_bounded_number_of_shapes() -> None:
    unbounded, bounded = held_mib("default"), held_mib("bounded")
    assert bounded <= ONEDNN_CACHE_SHAPES, (unbounded, bounded)  # under 1 MiB a shape kept
    assert unbounded > 2 * bounded, (unbounded, bounded)  # torch's defaults keep 1024 shapes


def test_a_cache_capacity_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)  # restored after the test
    assert bound_onednn_caches() == {
        "LRU_CACHE_CAPACITY": "7",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_SHAPES),
    }


def test_a_packed_weight_is_freed_before_the_next_checkpoint_tensor_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wing packs each linear as soon as its weight is loaded and frees the dense weight; neither
    the loader nor the packer may hold the old parameter, or every dense weight of the model lives
    until loading ends (Qwen2.5-Coder-1.5B with --quantization gguf peaked ~3 GB higher so)."""
    import sys
    import weakref

    from torch import nn

    from model_executor.cpu import linear as cpu_linear
    from model_executor.cpu.kernels import build
    from model_executor.cpu.weights import Packer
    from model_executor.distributed.communicator import Communicator
    from model_executor.layers.linear import ColumnParallelLinear
    from model_executor.loader.load_weights import load_weights
    from model_executor.loader.weight_source import LazyTensor

    # with AMX the dense weight stays for F.linear above AMX_MAX_ROWS: here every row count is packed
    monkeypatch.setattr(cpu_linear, "packed_max_rows", lambda: sys.maxsize)
    if not build.bf16_linear_available():
        pytest.skip("no packed bf16 linear on this CPU")
    model = nn.Sequential(
        *(
            ColumnParallelLinear(64, 64, False, Communicator.single(), params_dtype=torch.bfloat16)
            for _ in range(2)
        )
    )
    packer = Packer(model)
    first = weakref.ref(model[0].weight)

    def checkpoint():  # type: ignore[no-untyped-def]
        yield LazyTensor.from_tensor("0.weight", torch.ones(64, 64, dtype=torch.bfloat16))
        assert first() is None, "the first dense weight is still held"
        yield LazyTensor.from_tensor("1.weight", torch.ones(64, 64, dtype=torch.bfloat16))

    load_weights(model, checkpoint(), hooks=packer)
    assert model[0].weight.device.type == "meta" and model[1].weight.device.type == "meta"
