from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.cpu.kernels import ops
from model_executor.layers.sharding import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: `forward(x, residual)` returns
    (norm(x + residual), x + residual), so the residual stream is updated in one place."""

    def __init__(self, hidden_size: int, eps: float, *, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel; for bf16 it accumulates in fp32 (opmath), as transformers does.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if (
            ops.usable(x, self.weight)
            and x.is_contiguous()
            and (residual is None or residual.is_contiguous())
        ):
            out, new_residual = ops.rmsnorm(x, self.weight, self.eps, residual)  # one pass, add fused
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
