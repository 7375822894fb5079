"""CpuFusedOps: the fused ops (layers/fused_ops.py) on our kernels where they take the input (bf16 on
the CPU, the kernels built, the layout each kernel reads), the torch versions where they do not. The
CPU wing chooses them (wing.py); so does a process no wing has chosen for (device_wing.host_fused_ops).

The kernels are looked up through `ops` at each call, not bound here: a test that sets `ops.usable`
or an op sends every layer's call where it says.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from model_executor.cpu.kernels import build, ops
from model_executor.layers.fused_ops import FusedOps, LoraDeltas, LoraWeights, Rotary

_NORM_INPUTS = (torch.bfloat16, torch.float32)  # x of srt_rmsnorm*: bf16, or a layer's float32 output


class CpuFusedOps(FusedOps):
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _rmsnorm_applies(x, weight, residual):
            return ops.rmsnorm(x, weight, eps, residual)  # one pass, the add fused
        return super().rms_norm(x, weight, eps, residual)

    def rms_norm_start(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _rmsnorm_applies(x, weight, None):
            out, residual = ops.rmsnorm(x, weight, eps, keep_residual=True)
            assert residual is not None
            return out, residual
        return super().rms_norm_start(x, weight, eps)

    def rms_norm_f32w(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _rmsnorm_f32w_applies(x, out_dtype):
            return ops.rmsnorm_f32w(x.contiguous(), weight, eps, out_dtype, residual)
        return super().rms_norm_f32w(x, weight, eps, out_dtype, residual)

    def rms_norm_f32w_heads(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int
    ) -> torch.Tensor:
        if _rmsnorm_f32w_applies(x, x.dtype):
            out, _ = ops.rmsnorm_f32w(x.contiguous().view(-1, head_dim), weight, eps, x.dtype)
            return out.view(x.shape[0], -1)
        return super().rms_norm_f32w_heads(x, weight, eps, head_dim)

    def layer_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if ops.computes(dtype, x.device):
            normed, rounded = ops.layernorm(x.contiguous(), weight, bias, eps, residual, True)
            assert rounded is not None
            return normed, rounded
        return super().layer_norm(x, weight, bias, eps, residual, dtype)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if ops.usable(x) and x.is_contiguous():
            return ops.silu_mul(x)
        return super().silu_mul(x)

    def gelu_mul(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        if approximate == "tanh" and ops.usable(x) and x.is_contiguous():
            return ops.gelu_tanh_mul(x)  # one pass, rounded once
        return super().gelu_mul(x, approximate)

    def gelu_erf(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if ops.computes(dtype, x.device):
            return ops.gelu_erf(x.contiguous())
        return super().gelu_erf(x, dtype)

    def rope(self, rotary: Rotary, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if ops.usable(x, rotary.cos) and x.stride(1) == rotary.head_dim and positions.is_contiguous():
            return ops.rope(x, positions, rotary.cos, rotary.sin)
        return super().rope(rotary, positions, x)

    def encoder_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: list[int],
        head_dim: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        if ops.computes(dtype, q.device) and q.stride(1) == 1:  # in one call (srt_encoder_attention)
            return ops.encoder_attention(q, k, v, lengths, head_dim, head_dim**-0.5)
        return super().encoder_attention(q, k, v, lengths, head_dim, dtype)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        tokens = ops.argmax(logits)  # faster than torch's where it applies (docs/performance.md)
        return super().argmax(logits) if tokens is None else tokens

    def lora_delta(self, out: torch.Tensor, x: torch.Tensor, lora: LoraDeltas) -> None:
        # every adapter's rows in one call, each row on its own (batch-invariant)
        if lora.table is None or not ops.lora_delta(out, x, lora.row_slots, lora.table):
            super().lora_delta(out, x, lora)

    def lora_table(self, adapters: Mapping[int, LoraWeights]) -> torch.Tensor | None:
        """srt_lora_delta's table (cpu_lora.c): per slot A's address, its rows, its parts, then each
        part's first row, rank, first output, outputs and B's address (transposed); None where the kernel
        cannot take them (not built, not on the CPU, more parts than a slot holds)."""
        words = ops.lora_slot_words()
        if words is None or not adapters:
            return None
        table = torch.zeros(max(adapters) + 1, words, dtype=torch.int64)
        for slot, lora in adapters.items():
            tensors = (lora.a, *(part.bt for part in lora.parts))
            if 3 + 5 * len(lora.parts) > words or any(
                t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors
            ):
                return None
            entry = [lora.a.data_ptr(), lora.a.shape[0], len(lora.parts)]
            for part in lora.parts:
                entry += [part.ranks.start, part.ranks.stop - part.ranks.start, part.outputs.start]
                entry += [part.outputs.stop - part.outputs.start, part.bt.data_ptr()]
            table[slot, : len(entry)] = torch.tensor(entry, dtype=torch.int64)
        return table


def _rmsnorm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether srt_rmsnorm takes it: a bf16 weight, x bf16 or float32, the residual float32."""
    return (
        x.dtype in _NORM_INPUTS
        and ops.usable(weight)
        and x.device.type == "cpu"
        and x.is_contiguous()
        and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))
    )


def _rmsnorm_f32w_applies(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether srt_rmsnorm_f32w takes it: x and the result bf16 or float32, on the CPU."""
    return (
        x.device.type == "cpu"
        and x.dtype in _NORM_INPUTS
        and out_dtype in _NORM_INPUTS
        and build.kernels() is not None
    )
