"""FusedOps: the ops a layer may run in one pass on its device's kernels (norms with the residual add
fused, gated activations, rotary, an encoder's attention, the argmax), each with its torch version
here.

A layer binds the process's ops as it is built (`fused_ops()`) and calls them; it names no kernel. A
device's wing chooses them once, as it is made, before any model is built (DeviceWing.fused_ops):
the CPU's (model_executor/cpu/fused_ops.py) runs each op on its kernel where the kernel takes the
input and on the torch version here where it does not, as SGLang's CustomOp picks `forward_cpu` or
`forward_native`. A model built outside a ModelRunner (tests, scripts) gets the host's ops, the
CPU's (device_wing.host_fused_ops).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F


class Rotary(Protocol):
    """What the rotary op reads of a RotaryEmbedding (layers/rotary.py)."""

    head_dim: int
    cos: torch.Tensor  # [positions, head_dim]: [cos, cos]
    sin: torch.Tensor  # [positions, head_dim]: [-sin, sin]

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, [n, 1, head_dim], gathered once per forward."""
        ...


class LoraPartWeights(Protocol):
    """One adapted module of a layer's adapter (lora/linear_method.py's LoraPart)."""

    @property
    def ranks(self) -> slice: ...  # its rows of the adapter's stacked A
    @property
    def outputs(self) -> slice: ...  # the output columns its B writes
    @property
    def bt(self) -> torch.Tensor: ...  # float32 [rank, outputs]: B scaled, transposed


class LoraWeights(Protocol):
    """One adapter on one layer (lora/linear_method.py's LayerLora)."""

    @property
    def a(self) -> torch.Tensor: ...  # float32 [sum of ranks, inputs]
    @property
    def parts(self) -> Sequence[LoraPartWeights]: ...


class LoraDeltas(Protocol):
    """What the lora_delta op reads of a layer's adapters for one step (lora/linear_method.py)."""

    @property
    def row_slots(self) -> torch.Tensor: ...  # int32 [m]: each row's adapter slot, -1 for none
    @property
    def table(self) -> torch.Tensor | None: ...  # the device's lora_table (None: no kernel takes it)

    def add_each(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """The torch products: one pair of matmuls per adapter of the step."""
        ...


class FusedOps:
    """The torch versions. Every op allocates its outputs and mutates none of its inputs."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rmsnorm(x + residual) * weight in the weight's dtype, x + residual); without a residual
        (rmsnorm(x) * weight, None). The residual stream is float32 (layers/layernorm.py)."""
        if residual is None:
            return _rms_norm(x, weight, eps), None
        residual = residual + x
        return _rms_norm(residual, weight, eps), residual

    def rms_norm_start(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x) * weight, the float32 residual stream begun at x): a decoder's first layer."""
        return _rms_norm(x, weight, eps), x.float()

    def rms_norm_f32w(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rms_norm with a float32 weight (Gemma's 1 + w), in float32, the result in `out_dtype`."""
        if residual is None:
            return _rms_norm_f32w(x, weight, eps, out_dtype), None
        residual = residual + x
        return _rms_norm_f32w(residual, weight, eps, out_dtype), residual

    def rms_norm_f32w_heads(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int
    ) -> torch.Tensor:
        """[n, heads * head_dim] normalized per head with a float32 weight, in x's dtype."""
        n = x.shape[0]
        return _rms_norm_f32w(x.reshape(n, -1, head_dim), weight, eps, x.dtype).view(n, -1)

    def layer_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layernorm(x + residual) in float32 with float32 weight and bias, the same in `dtype`)."""
        summed = x.float() if residual is None else residual + x.float()
        normed = F.layer_norm(summed, x.shape[-1:], weight, bias, eps)
        return normed, normed.to(dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[.., 2d] (gate | up) -> silu(gate) * up, [.., d]."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def gelu_mul(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        """[.., 2d] (gate | up) -> gelu(gate) * up, [.., d]; `approximate` as torch's gelu takes it."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]

    def gelu_erf(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The exact (erf) GELU of float32 x, rounded once to `dtype`."""
        return F.gelu(x).to(dtype)

    def rope(self, rotary: Rotary, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated at `positions`: x * [cos, cos] + roll(x, d/2) * [-sin, sin],
        transformers' x * cos + rotate_half(x) * sin in the same float operations."""
        cos, sin = rotary.rows(positions)
        return x * cos + torch.roll(x, rotary.head_dim // 2, dims=-1) * sin

    def encoder_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: list[int],
        head_dim: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v within each request (layers/attention.py, encoder_attention), per
        request as two batched products over the heads: at an encoder's lengths faster than
        scaled_dot_product_attention, whose CPU path for 3-D inputs is its unfused math one
        (docs/performance.md)."""
        scale = head_dim**-0.5
        q, k, v = (t.unflatten(-1, (-1, head_dim)).transpose(0, 1) for t in (q, k, v))
        out = torch.empty(q.shape[1], q.shape[0], head_dim, dtype=dtype)  # [tokens, heads, head_dim]
        start = 0
        for length in lengths:
            rows = slice(start, start + length)
            # beta=0: the first argument only shapes the result
            scores = q.new_empty(q.shape[0], length, length)
            scores = torch.baddbmm(scores, q[:, rows], k[:, rows].transpose(1, 2), beta=0, alpha=scale)
            out[rows] = torch.bmm(scores.softmax(-1), v[:, rows]).transpose(0, 1)
            start += length
        return out.flatten(1)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] -> each row's argmax, int64."""
        return logits.argmax(dim=-1)

    def lora_delta(self, out: torch.Tensor, x: torch.Tensor, lora: LoraDeltas) -> None:
        """Adds the LoRA delta of each of x's rows under an adapter into out's row, in place (x [m, k],
        out [m, n], a layer's input and output): lora/linear_method.py's torch products, one pair
        of matmuls per adapter of the step."""
        lora.add_each(out, x)

    def lora_table(self, adapters: Mapping[int, LoraWeights]) -> torch.Tensor | None:
        """What a device's lora_delta reads of a layer's adapters by slot, made as they attach
        (None: the torch products)."""
        return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """-> the weight's dtype (the model's), whatever x's."""
    if x.dtype == weight.dtype:
        # One fused kernel; for bf16 it accumulates in fp32 (opmath), as transformers does.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return (F.rms_norm(x, (x.shape[-1],), None, eps) * weight).to(weight.dtype)  # rounded once


def _rms_norm_f32w(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(out_dtype)


TORCH_OPS = FusedOps()  # holds nothing: one for every layer that runs torch's ops alone
_chosen: FusedOps | None = None


def use_fused_ops(ops: FusedOps) -> None:
    """The ops every layer built from now on calls (a device wing's choice, made once as it is made)."""
    global _chosen
    _chosen = ops


def fused_ops() -> FusedOps:
    """The ops the process's device wing chose; before any wing, the host's (the CPU's)."""
    if _chosen is None:
        from model_executor.device_wing import host_fused_ops  # device_wing imports this module

        use_fused_ops(host_fused_ops())
    assert _chosen is not None
    return _chosen
