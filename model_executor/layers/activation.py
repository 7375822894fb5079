from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.cpu.kernels import ops


class SiluAndMul(nn.Module):
    """[.., 2d] (gate | up) -> silu(gate) * up, [.., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.usable(x) and x.is_contiguous():
            return ops.silu_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """[.., 2d] (gate | up) -> gelu(gate) * up, [.., d] (Gemma's GeGLU; approximate "tanh" is
    transformers' gelu_pytorch_tanh, "none" its exact gelu)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "tanh" and ops.usable(x) and x.is_contiguous():
            return ops.gelu_tanh_mul(x)  # one pass, rounded once
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def gelu_erf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gelu(x), the exact (erf) GELU, of float32 x, in `dtype` (rounded once): srt_gelu_erf for bf16
    on the CPU kernels, torch's otherwise."""
    if ops.computes(dtype, x.device):
        return ops.gelu_erf(x.contiguous())
    return F.gelu(x).to(dtype)
