from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.layers.fused_ops import TORCH_OPS, fused_ops
from model_executor.layers.sharding import check_shape, default_weight_loader, read_all, set_weight_attrs


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
        self.ops = fused_ops()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """x: the model dtype, or float32 (a layer's output); residual: the float32 stream."""
        out, new_residual = self.ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)

    def start(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), the float32 residual stream begun at x), for a decoder's first layer."""
        return self.ops.rms_norm_start(x, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32 (transformers' Gemma3RMSNorm), the result in
    `out_dtype`. The weight is kept as the float32 1 + w the checkpoint's w gives, so the scale is
    not rounded to the model dtype. `forward(x, residual)` fuses the residual add as RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float, *, out_dtype: torch.dtype, kernel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.out_dtype = out_dtype
        # `kernel`: the device's fused op where it takes x (a bf16 model's default path), else torch's ops
        self.ops = fused_ops() if kernel else TORCH_OPS
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: object = None) -> None:
        check_shape(param, tuple(loaded.shape))
        with torch.no_grad():
            param.copy_(read_all(loaded).float() + 1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        out, new_residual = self.ops.rms_norm_f32w(x, self.weight, self.eps, self.out_dtype, residual)
        return out if residual is None else (out, new_residual)

    def heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """[n, heads * head_dim] normalized per head (Gemma 3's q_norm and k_norm), in x's dtype."""
        return self.ops.rms_norm_f32w_heads(x, self.weight, self.eps, head_dim)


class HeadsRMSNorm(nn.Module):
    """An RMSNorm over all the heads of q (or k) at once, not per head (OLMoE's q_norm and k_norm),
    where tensor parallelism gives each rank `local_size` of the `full_size` columns: the rank's
    slice `shard` of the weight. The mean of squares spans every rank's columns, so the ranks'
    sums of squares are all-reduced (`scale`'s caller does it once for q and k together); a slice
    held by `replicas` ranks (k with fewer KV heads than ranks) counts once."""

    def __init__(
        self,
        full_size: int,
        local_size: int,
        shard: int,
        replicas: int,
        eps: float,
        *,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.full_size = full_size
        self.shard = shard
        self.replicas = replicas
        self.weight = nn.Parameter(torch.ones(local_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: object = None) -> None:
        size = param.shape[0]
        if tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"expected ({self.full_size},), got {tuple(loaded.shape)}")
        with torch.no_grad():
            param.copy_(loaded.narrow(0, self.shard * size, size))

    def sum_squares(self, x: torch.Tensor) -> torch.Tensor:
        """[n, local_size] -> float32 [n, 1]: this rank's share of the rows' sums of squares."""
        return x.float().pow(2).sum(dim=-1, keepdim=True) / self.replicas

    def scale(self, x: torch.Tensor, sum_squares: torch.Tensor) -> torch.Tensor:
        """x normalized by every rank's sum of squares (all-reduced), times the weight, as
        transformers' RMSNorm rounds it: the normalized row in x's dtype, then the weight."""
        inv = torch.rsqrt(sum_squares / self.full_size + self.eps)
        return self.weight * (x.float() * inv).to(x.dtype)


class LayerNorm(nn.Module):
    """transformers' LayerNorm (weight and bias; BERT's post-norms), in float32 whatever the model's dtype: its
    parameters are kept in float32 as loaded."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps
        self.ops = fused_ops()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layernorm(x + residual) in float32, the same in `dtype`, the next linear's input): in one
        pass where the device has a fused op for it (the CPU's, for a bf16 model), else op by op."""
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps, residual, dtype)
