"""The oneDNN bf16 path gives F.linear's results and is used for every linear layer in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_executor.layers.cpu_linear import linear, onednn_bf16_available, pack_weight
from model_executor.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 on this CPU")


@pytest.mark.parametrize("m", [1, 7, 64])
def test_packed_bf16_linear_matches_f_linear(m: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(m, 48, generator=g).bfloat16()
    packed = pack_weight(weight)
    assert packed is not None
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-2, atol=1e-2)
    assert pack_weight(weight.float()) is None  # fp32 stays on F.linear


def test_bf16_runner_packs_every_linear(tiny_model_dirs: dict[str, Path]) -> None:
    runner = ModelRunner(RunnerConfig(model_dir=tiny_model_dirs["llama"], dtype=torch.bfloat16, max_total_tokens=256))
    layers = [m for m in runner.model.modules() if hasattr(m, "packed_weight")]
    assert layers and all(m.packed_weight is not None for m in layers)
    fp32 = ModelRunner(RunnerConfig(model_dir=tiny_model_dirs["llama"], dtype=torch.float32, max_total_tokens=256))
    assert all(m.packed_weight is None for m in fp32.model.modules() if hasattr(m, "packed_weight"))
