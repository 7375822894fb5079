"""bf16 matmuls on the CPU with weights packed once at load time.

Decode steps multiply a few rows by each weight, so a linear layer is a stream of its weight from
memory. Where the CPU has AMX, AVX-512 BF16, or AVX2 and FMA, the weight is packed in the order
srt_bf16_linear reads it (model_executor/cpu/kernels/cpu_bf16_linear.c, on AMX tiles or vdpbf16ps;
cpu_avx2_linear.c, widened to fp32 in registers): measured on SmolLM2's 30 layers with weights not
in cache, the AMX kernel streams them faster than oneDNN's packed GEMM and F.linear from 1 to 32
rows and stays ahead up to a few hundred rows; the AVX-512 one (AMD Zen 4) is faster than oneDNN's
from 1 to 256 rows and equals it up to 4096; the AVX2 one (AMD Zen 3, where torch has no fast bf16
matmul) is several times faster than F.linear at every row count (figures in docs/performance.md).
On AMX, larger prefill chunks use F.linear (`packed_max_rows`). Without any of them the weight is
reordered for oneDNN's bf16 kernel, faster than ATen's bf16 GEMM at small M, with bit-identical
results. fp32 and other devices keep F.linear. A layer reaches all of this through
its linear method (PackedLinearMethod, set by weights.pack_model), knowing nothing of the layout.

With --quantization w8a8_int8 (SGLang's name for it on CPU) every weight whose shape allows
becomes int8 with one scale per output (packing.int8_pack) and every linear of every size runs on
the int8 kernel (AMX tiles, or AVX-512 VNNI), its input quantized per row: half the bytes per
decode step, and twice bf16's multiply rate both on AMX and on Zen 4's VNNI (a 512-bit vpdpbusd
issues as often as a vdpbf16ps and does twice the multiply-adds). Not bit-identical to bf16: a
separate mode, off by default.

With --quantization gguf (vLLM's name for running a GGUF file's own quantized weights) every such
layer of a checkpoint converted from a GGUF Q4_1 file keeps the file's 4-bit blocks (recovered
exactly from the dequantized values, packing.q4_recover) for decode steps of up to ops.Q4_MAX_ROWS
rows, where a step streams every weight once: 0.625 bytes a weight against bf16's 2, every weight
exact (bf16 rounds them to 8 bits). Larger batches and prefills widen the blocks to bf16 a task at a
time (srt_gguf_linear: the bits a bf16 copy gives, without keeping one), or where that kernel does not
run, use a bf16 copy.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from model_executor.cpu.kernels import build, ops, packing
from model_executor.layers.linear_method import LinearLayer, LinearMethod

AMX_MAX_ROWS = 1024  # above this, F.linear (oneDNN) is faster than the AMX kernel (docs/performance.md)
# what PackedLinearMethod multiplies by (pack_weight)
PackedWeight = (
    torch.Tensor
    | packing.Int8Weight
    | packing.Q4Weight
    | packing.Q4KWeight
    | packing.Q5KWeight
    | packing.Q8Weight
    | packing.SplitWeight
)
# the weights of the 4-bit kernel (cpu_q4_linear.c: Q4_1, Q4_K, and Q5_K with its fifth bits)
FOUR_BIT = (packing.Q4Weight, packing.Q4KWeight, packing.Q5KWeight)
GGUF = (*FOUR_BIT, packing.Q8Weight)  # a GGUF weight's blocks (and a bf16 copy where no srt_gguf_linear)


def onednn_bf16_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_one_arithmetic = False  # set_one_arithmetic


def set_one_arithmetic(on: bool) -> None:
    """Deterministic inference (this process's ranks): every row of every size on the kernel a
    packed weight was packed for, so a row's bits never depend on how many rows share its call."""
    global _one_arithmetic
    _one_arithmetic = on


def packed_max_rows() -> int:
    """The most rows srt_bf16_linear takes a packed bf16 weight for (F.linear above): AMX_MAX_ROWS on
    AMX; any number on AVX-512 BF16, which kept up with oneDNN's GEMM at 4096 rows and spares a
    prefill's MLP the separate silu pass, and on AVX2, where F.linear's bf16 GEMM is several times
    slower at every row count (docs/performance.md)."""
    return AMX_MAX_ROWS if build.amx_available() and not _one_arithmetic else sys.maxsize


def reads_dense(packed: PackedWeight) -> bool:
    """Whether `linear` may still read a layer's weight as loaded beside `packed`: a oneDNN-reordered
    weight (torch.mv at one row), or F.linear above packed_max_rows() (on AMX). Where not, the wing
    frees it (weights.pack_model)."""
    if isinstance(packed, GGUF) and packed.bf16 is None:
        return False  # every row count on its blocks
    if isinstance(packed, packing.SplitWeight):
        return any(reads_dense(part) for part in packed.parts)
    return not is_kernel_packed(packed) or packed_max_rows() != sys.maxsize


def is_kernel_packed(packed: PackedWeight) -> bool:
    """Whether our kernels read `packed` (srt_bf16_linear's, the int8 or a GGUF layout), not oneDNN."""
    quantized = (packing.Int8Weight, *FOUR_BIT, packing.Q8Weight, packing.SplitWeight)
    # packing.bf16_pack's layout is 5-D, oneDNN's packed weight 2-D
    return isinstance(packed, quantized) or packed.dim() == 5


def pack_weight(
    weight: torch.Tensor,
    quantization: str | None = None,
    q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    q8: tuple[torch.Tensor, torch.Tensor] | None = None,
    q5: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> PackedWeight | None:
    """The packed copy of a 2-D bf16 CPU weight, or None where F.linear is the right path; with `q4`
    (the weight's Q4_1 blocks, packing.q4_recover) a Q4Weight, or with its Q4_K blocks (float32 d,
    packing.q4k_recover) a Q4KWeight (q4ks_pack's layout where its scales factor as a file's), with `q8` (Q8_0, Q5_0 or Q4_0, packing.q8_recover; or Q6_K,
    packing.q6k_recover) a Q8Weight, with `q5` (Q5_K, packing.q5k_recover) a Q5KWeight."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None

    if any(b is not None for b in (q4, q5, q8)) and packing.bf16_packable(weight):
        # for more rows than the blocks' kernel takes: srt_gguf_linear on the blocks, or a bf16 copy
        return pack_blocks(q4, q8, q5, None if build.gguf_linear_available() else packing.bf16_pack(weight))
    if quantization == "w8a8_int8" and packing.int8_packable(weight):
        return packing.int8_pack(weight)
    if packing.bf16_packable(weight) and build.bf16_linear_available():
        return packing.bf16_pack(weight)
    if not onednn_bf16_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def pack_blocks(
    q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    q8: tuple[torch.Tensor, torch.Tensor] | None,
    q5: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    bf16: torch.Tensor | None = None,
    factors: tuple[torch.Tensor, ...] | None = None,
) -> packing.GgufWeight:
    """A GGUF weight on the first of its blocks given (pack_weight's), with `bf16` (bf16_pack's)
    for the row counts srt_gguf_linear does not take, or None where it takes them all. `factors`:
    the file's super-block factors of the Q4_K or Q6_K blocks given (loader/gguf_blocks.py)."""
    if q4 is not None:
        if q4[1].dtype != torch.float32:
            return packing.Q4Weight(packing.q4_pack(*q4), bf16)
        compact = packing.q4ks_pack(
            *q4, factors
        )  # a file's super-blocks: its six-bit scales, 0.59 bytes a weight
        return packing.Q4KWeight(compact if compact is not None else packing.q4_pack(*q4), bf16)
    if q5 is not None:
        return packing.Q5KWeight(packing.q5k_pack(*q5), bf16)
    assert q8 is not None, "no blocks to pack"
    compact = (
        packing.q6ks_pack(*q8, factors) if q8[1].dtype == torch.float32 else None
    )  # Q6_K: a file's int8 scales
    return packing.Q8Weight(compact if compact is not None else packing.q8_pack(*q8), bf16)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), in x's dtype, or in `out_dtype` (float32 for logits: our kernel then
    stores the widened bf16 values itself, as .float() would, without a second pass)."""
    out = _linear(x, weight, bias, packed, out_dtype == torch.float32)
    return out if out_dtype is None else out.to(out_dtype)  # a no-op where the kernel wrote float32


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | None,
    float32_out: bool,
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, packing.Int8Weight):
        return ops.int8_linear(x.contiguous(), packed, bias)
    if isinstance(packed, packing.SplitWeight):  # each part's rows on its own blocks, side by side
        outs, start = [], 0
        for part, n in zip(packed.parts, packed.rows):
            part_bias = None if bias is None else bias[start : start + n]
            outs.append(_linear(x, weight[start : start + n], part_bias, part, float32_out))
            start += n
        return torch.cat(outs, dim=-1)
    rows = x.numel() // x.shape[-1]
    if isinstance(packed, FOUR_BIT):
        if rows <= ops.q4_max_rows(packed.packed):
            out_dtype = torch.float32 if float32_out else torch.bfloat16
            return ops.q4_linear(x.contiguous(), packed.packed, bias, out_dtype)
    if isinstance(packed, packing.Q8Weight):
        if rows <= ops.q8_max_rows(packed.packed):
            out = ops.q8_linear(x.contiguous(), packed.packed)
            if bias is not None:
                out += bias.float()
            return out if float32_out else out.to(x.dtype)
    if isinstance(packed, GGUF):  # more rows than its blocks' kernel takes
        if packed.bf16 is None:
            out_dtype = torch.float32 if float32_out else torch.bfloat16
            return ops.gguf_linear(x.contiguous(), packed.packed, bias, out_dtype)
        packed = packed.bf16
    if is_kernel_packed(packed):
        if rows <= packed_max_rows():
            return ops.bf16_linear(
                x.contiguous(), packed, bias, torch.float32 if float32_out else torch.bfloat16
            )
        return F.linear(x, weight, bias)
    if rows == 1 and not _one_arithmetic:
        # One row (batch-1 decode): ATen's bf16 gemv streams the weight faster than oneDNN's
        # packed GEMM at M = 1 (measured on SmolLM2's LM head: docs/performance.md).
        out = torch.mv(weight, x.reshape(-1))
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], out.shape[-1])
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
    return out.view(*shape[:-1], out.shape[-1])


def linear_silu_mul(
    x: torch.Tensor, packed: PackedWeight | None, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """silu(gate) * up of x @ gate_up.T in one pass where `packed` is a gate_up weight without bias
    for a kernel of ours that `linear` would use on x (int8: any rows; bf16: at most packed_max_rows()),
    the [rows, 2d] product never stored; equal to silu_mul(linear(...)). Else None."""
    if packed is None or bias is not None or isinstance(packed, (packing.Q8Weight, packing.SplitWeight)):
        return None
    if isinstance(packed, packing.Int8Weight):
        return ops.int8_linear_silu(x.contiguous(), packed)
    rows = x.numel() // x.shape[-1]
    if isinstance(packed, FOUR_BIT):
        if rows <= ops.q4_max_rows(packed.packed):
            return ops.q4_linear_silu(x.contiguous(), packed.packed)
        if packed.bf16 is None:
            return ops.gguf_linear_silu(x.contiguous(), packed.packed)
        packed = packed.bf16
    if not is_kernel_packed(packed) or rows > packed_max_rows():
        return None
    return ops.bf16_linear_silu(x.contiguous(), packed)


class PackedLinearMethod(LinearMethod):
    """A layer's linear on its weight packed for our kernels or oneDNN (pack_weight), set by
    weights.pack_model. The weight as loaded stays the layer's where the rows the packed copy does
    not take (F.linear above packed_max_rows, torch.mv at one row) read it (reads_dense); elsewhere
    pack_model leaves only its shape (a meta tensor)."""

    def __init__(self, packed: PackedWeight) -> None:
        self.packed = packed

    @property
    def packed_weight(self) -> PackedWeight:
        return self.packed

    def apply(
        self,
        layer: LinearLayer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias, self.packed, out_dtype)

    def apply_silu_mul(
        self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        return linear_silu_mul(x, self.packed, bias)


def packed_of(method: LinearMethod) -> PackedWeight | None:
    """The packed weight a layer's linear method multiplies by (LoRA's method: its base method's),
    or None (the weight as loaded)."""
    packed = method.packed_weight
    return packed if isinstance(packed, PackedWeight) else None
