from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.cpu.kernels import build, ops
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32 (transformers' Gemma3RMSNorm), the result in
    `out_dtype`. The weight is kept as the float32 1 + w the checkpoint's w gives, so the scale is
    not rounded to the model dtype. `forward(x, residual)` fuses the residual add as RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float, *, out_dtype: torch.dtype, kernel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.out_dtype = out_dtype
        self.kernel = kernel  # srt_rmsnorm_f32w where it takes x (a bf16 model's default path)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: object = None) -> None:
        check_shape(param, tuple(loaded.shape))
        with torch.no_grad():
            param.copy_(read_all(loaded).float() + 1.0)

    def _norm(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * self.weight).to(out_dtype)

    def _use_kernel(self, x: torch.Tensor, out_dtype: torch.dtype) -> bool:
        return (
            self.kernel
            and x.device.type == "cpu"
            and x.dtype in (torch.bfloat16, torch.float32)
            and out_dtype in (torch.bfloat16, torch.float32)
            and build.kernels() is not None
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self._use_kernel(x, self.out_dtype):
            out, new_residual = ops.rmsnorm_f32w(
                x.contiguous(), self.weight, self.eps, self.out_dtype, residual
            )
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x, self.out_dtype)
        residual = residual + x
        return self._norm(residual, self.out_dtype), residual

    def heads(self, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """[n, heads * head_dim] normalized per head (Gemma 3's q_norm and k_norm), in x's dtype."""
        n = x.shape[0]
        if self._use_kernel(x, x.dtype):
            out, _ = ops.rmsnorm_f32w(x.contiguous().view(-1, head_dim), self.weight, self.eps, x.dtype)
            return out.view(n, -1)
        return self._norm(x.reshape(n, -1, head_dim), x.dtype).view(n, -1)


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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layernorm(x + residual) in float32, the same in `dtype`, the next linear's input): in one
        pass of srt_layernorm for a bf16 model on the CPU kernels, op by op otherwise."""
        if ops.computes(dtype, x.device):
            normed, rounded = ops.layernorm(x.contiguous(), self.weight, self.bias, self.eps, residual, True)
            assert rounded is not None
            return normed, rounded
        summed = x.float() if residual is None else residual + x.float()
        normed = F.layer_norm(summed, x.shape[-1:], self.weight, self.bias, self.eps)
        return normed, normed.to(dtype)
