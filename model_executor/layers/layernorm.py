from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.cpu.kernels import ops
from model_executor.layers.sharding import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: `forward(x, residual)` returns
    (norm(x + residual), x + residual), so the residual stream is updated in one place.

    The residual stream is float32 whatever the model dtype (`start` begins it at a decoder's first
    layer): each layer's output (float32 from RowParallelLinear) is added to it unrounded and only
    the norm's output takes the model dtype. A bf16 stream rounds every layer's sum to 8 bits; in float32 the default path stays
    nearer transformers' float32 than transformers' own bf16 does (docs/performance.md)."""

    def __init__(self, hidden_size: int, eps: float, *, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """-> the weight's dtype (the model's), whatever x's."""
        if x.dtype == self.weight.dtype:
            # One fused kernel; for bf16 it accumulates in fp32 (opmath), as transformers does.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return (F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight).to(
            self.weight.dtype
        )  # rounded once

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether srt_rmsnorm takes it: a bf16 weight, x bf16 or float32 (a row-parallel layer's
        output), the residual float32."""
        return (
            x.dtype in (torch.bfloat16, torch.float32)
            and ops.usable(self.weight)
            and x.device.type == "cpu"
            and x.is_contiguous()
            and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """x: the model dtype, or float32 (a layer's output); residual: the float32 stream."""
        if self._kernel(x, residual):
            out, new_residual = ops.rmsnorm(x, self.weight, self.eps, residual)  # one pass, add fused
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def start(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), the float32 residual stream begun at x), for a decoder's first layer."""
        if self._kernel(x, None):
            out, residual = ops.rmsnorm(x, self.weight, self.eps, keep_residual=True)
            assert residual is not None
            return out, residual
        return self._norm(x), x.float()
