from __future__ import annotations

import torch
from torch import nn

from model_executor.layers.fused_ops import fused_ops


class GeluAndMul(nn.Module):
    """[.., 2d] (gate | up) -> gelu(gate) * up, [.., d] (Gemma's GeGLU; approximate "tanh" is
    transformers' gelu_pytorch_tanh, "none" its exact gelu)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate
        self.ops = fused_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_mul(x, self.approximate)


def gelu_erf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gelu(x), the exact (erf) GELU, of float32 x, in `dtype` (rounded once): in one pass where the
    device has a fused op for it (the CPU's, for bf16), torch's otherwise."""
    return fused_ops().gelu_erf(x, dtype)
