"""A loaded model's weights laid out for the CPU kernels, once at start-up (the CPU wing's
prepare_weights): every linear layer's weight packed for the kernel that multiplies by it
(cpu/linear.py), as int8 with --quantization w8a8_int8, as a GGUF file's own blocks (Q4_1, Q4_K,
Q5_K, Q8_0, Q5_0, Q4_0, Q6_K, and a Q8_0 LM head) with --quantization gguf."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from model_executor.cpu.kernels import build, packing
from model_executor.cpu.linear import PackedLinearMethod, pack_weight, packed_of, set_one_arithmetic
from model_executor.cpu.moe import fuse_experts
from model_executor.layers.linear import LinearBase
from model_executor.layers.linear_method import UNQUANTIZED

logger = logging.getLogger("srt.model_runner")  # the start-up lines keep the logger they always had

QUANTIZATIONS = ("w8a8_int8", "gguf")


def check_quantization(quantization: str | None, dtype: torch.dtype, device: str) -> None:
    """Raises ValueError naming what --quantization needs and this process lacks."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device != "cpu" or dtype != torch.bfloat16:
        raise ValueError(
            f"--quantization {quantization} runs on --device cpu with bfloat16 activations; "
            f"got {device} with {dtype}"
        )
    if quantization == "gguf":
        if not (build.bf16_linear_available() and (build.q4_available() or build.q8_available())):
            raise ValueError(
                "--quantization gguf needs the CPU kernels built and a CPU with AVX-512 BF16 (AMD Zen 4 or "
                "later, Intel Cooper Lake or later) or AVX2, FMA and F16C (Q4_1 layers and a Q8_0 LM "
                "head); this process has neither"
            )
        return
    if not build.int8_available():
        raise ValueError(
            f"--quantization {quantization} needs a CPU with AMX int8 tiles (Intel Xeon 4th "
            "generation or later) or AVX-512 VNNI (AMD Zen 4 or later, Intel Ice Lake or later) "
            "and the CPU kernels built; this process has neither"
        )


def gguf_bf16_reason() -> str:
    """Why a --quantization gguf layer stays bf16 on this CPU, as pack_model logs it."""
    eight = ", Q8_0, Q5_0, Q4_0 or Q6_K" if build.q8_available() else ""
    if build.q5k_available():  # wherever Q4_1's kernel runs (cpu_q4_linear.c: both ISA paths)
        return f"not Q4_1, Q4_K, Q5_K{eight} (another type)"
    return "no 4-bit kernel on this CPU"


Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def gguf_blocks(
    exact: torch.Tensor, quantizable: bool
) -> tuple[Blocks | None, Blocks | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the Q4_1 or Q4_K blocks, the Q5_K blocks, the Q8_0, Q5_0, Q4_0 or Q6_K blocks) of a layer's
    exact float32 weight that this CPU has a kernel for, each None where the weight is not so or the
    kernel is missing; at most one is found. The 4-bit ones, Q5_K and Q6_K only for a quantizable
    layer (the LM head is not: it runs Q8_0-style blocks only). Q6_K's come as q8_recover's form
    with float32 D, one per 16 k. Q4_K before Q5_K: a Q4_K weight is a Q5_K one too."""
    q4 = packing.q4_recover(exact) if quantizable and build.q4_available() else None
    if quantizable and q4 is None and build.q4k_available():
        q4 = packing.q4k_recover(exact)
    q8 = packing.q8_recover(exact) if q4 is None and build.q8_available() else None
    q5 = None
    if quantizable and q4 is None and q8 is None and build.q5k_available():
        q5 = packing.q5k_recover(exact)
    if quantizable and q4 is None and q5 is None and q8 is None and build.q8_available():
        q8 = packing.q6k_recover(exact)
    return q4, q5, q8


def pack_model(
    model: nn.Module, quantization: str | None = None, float32_model: nn.Module | None = None
) -> int:
    """Packs every linear layer (LinearBase), setting its linear method to a PackedLinearMethod (or
    UNQUANTIZED where pack_weight leaves the weight as loaded), as int8 with w8a8_int8 unless the layer says `quantizable = False` (the LM head, as in SGLang and vLLM), or
    with gguf as its Q4_1 (or Q4_K, or Q5_K) blocks, or its Q8_0, Q5_0, Q4_0 or Q6_K blocks (on the 8-bit kernel),
    recovered from the same layer of `float32_model` (the same checkpoint loaded in float32: its
    exact dequantized values), and the LM head as its Q8_0 blocks where the file holds it so (a tied
    head: the token embedding). A gguf layer srt has no kernel for here (another type, or
    no kernel for it on this CPU) stays bf16, and the log names how many. Returns how many were packed. Call
    once, after the weights are loaded."""
    assert quantization != "gguf" or float32_model is not None, "gguf recovers its blocks from float32_model"
    count = 0
    float32_modules = dict(float32_model.named_modules()) if float32_model is not None else {}
    as_bf16: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, LinearBase) and isinstance(weight, torch.Tensor):
            quantizable = getattr(module, "quantizable", True)
            q4 = q5 = q8 = None
            if quantization == "gguf":
                q4, q5, q8 = gguf_blocks(float32_modules[name].weight, quantizable)
                if quantizable and q4 is None and q5 is None and q8 is None:
                    as_bf16.append(name)
            packed = pack_weight(weight, quantization if quantizable else None, q4, q8, q5)
            module.linear_method = PackedLinearMethod(packed) if packed is not None else UNQUANTIZED
            count += packed is not None
    if as_bf16:
        logger.info(
            "--quantization gguf: %d linear layers stay bf16 (%s): %s",
            len(as_bf16),
            gguf_bf16_reason(),
            ", ".join(as_bf16[:4]) + (", ..." if len(as_bf16) > 4 else ""),
        )
    return count


def prepare_weights(
    model: nn.Module,
    *,
    quantization: str | None,
    dtype: torch.dtype,
    deterministic: bool,
    load_float32: Callable[[], nn.Module],
) -> None:
    """Sets one arithmetic for deterministic inference (set_one_arithmetic) and packs the model's
    weights (pack_model; with gguf, the checkpoint loaded again through `load_float32`, then
    dropped); logs how many were packed and, for bf16 and fp16, the paths this CPU's kernels take."""
    set_one_arithmetic(deterministic)
    # gguf: the checkpoint's exact values, to find its Q4_1 blocks in
    float32_model = load_float32() if quantization == "gguf" else None
    packed = pack_model(model, quantization, float32_model)
    del float32_model
    fuse_experts(model)  # a mixture of experts: each layer's experts in one kernel call
    if packed:
        weights = [packed_of(m.linear_method) for m in model.modules() if isinstance(m, LinearBase)]
        kinds = (
            (packing.Int8Weight, "int8"),
            (packing.Q4Weight, "Q4_1"),
            (packing.Q4KWeight, "Q4_K"),
            (packing.Q5KWeight, "Q5_K"),
            (packing.Q8Weight, "8-bit (Q8_0, Q5_0, Q4_0 or Q6_K blocks)"),
        )
        counts = [(sum(isinstance(w, kind) for w in weights), name) for kind, name in kinds]
        quantized = [f"{count} {name}" for count, name in counts if count]
        logger.info(
            "packed %d weights for the CPU kernels%s",
            packed,
            f", of them {', '.join(quantized)} ({quantization})" if quantization else "",
        )
    if dtype in (torch.bfloat16, torch.float16):
        logger.info(build.describe_paths())
