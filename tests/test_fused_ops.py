"""The fused ops a layer calls are its device wing's, chosen once: the CPU's kernels where they take
the input, torch's on a device without a wing, the CPU's for a model built outside a runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_executor.cpu.fused_ops import CpuFusedOps
from model_executor.cpu.kernels import build, ops
from model_executor.device_wing import device_wing
from model_executor.distributed.parallel_state import single_process_state
from model_executor.layers import fused_ops
from model_executor.layers.layernorm import RMSNorm
from model_executor.model_runner import RunnerConfig


def test_a_layer_calls_the_ops_of_the_wing_made_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_ops, "_chosen", None)  # a fresh process: no wing made yet
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    weight = torch.randn(64, generator=g).bfloat16()

    def norm() -> RMSNorm:
        layer = RMSNorm(64, 1e-6, params_dtype=torch.bfloat16)
        layer.weight.data = weight
        return layer

    outside = norm()  # a model built outside a ModelRunner: the host's ops, the CPU's
    assert type(outside.ops) is CpuFusedOps
    if build.kernels() is not None:
        assert torch.equal(outside(x), ops.rmsnorm(x, weight, 1e-6)[0])

    device_wing(RunnerConfig(model_dir=tmp_path, device="meta"), single_process_state())  # no wing of its own
    on_torch = norm()
    assert on_torch.ops is fused_ops.TORCH_OPS
    assert torch.equal(on_torch(x), F.rms_norm(x, (64,), weight, 1e-6))

    device_wing(RunnerConfig(model_dir=tmp_path), single_process_state())  # the CPU's wing
    assert type(norm().ops) is CpuFusedOps
    assert on_torch.ops is fused_ops.TORCH_OPS  # chosen once: a layer keeps what it was built with
