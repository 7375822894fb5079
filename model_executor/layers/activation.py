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
