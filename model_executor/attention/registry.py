"""Attention backends by --attention-backend name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.attention.cpu_kernels_backend import CpuKernelsAttnBackend
from model_executor.attention.torch_native import TorchNativeAttnBackend


def _flashinfer(kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool) -> AttentionBackend:
    from model_executor.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(kv_pool, req_to_token)


ATTENTION_BACKENDS: dict[str, Callable[[KVPool, torch.Tensor, bool], AttentionBackend]] = {
    "torch_native": lambda kv_pool, req_to_token, deterministic: TorchNativeAttnBackend(
        kv_pool, req_to_token
    ),
    "cpu_kernels": CpuKernelsAttnBackend,
    "flashinfer": _flashinfer,
}


def default_attention_backend(device: torch.device) -> str:
    """--attention-backend auto: our kernels on the CPU (torch SDPA wherever they do not apply), torch
    SDPA elsewhere (flashinfer becomes the CUDA default once its backend exists)."""
    return "cpu_kernels" if device.type == "cpu" else "torch_native"


def create_attention_backend(
    name: str, device: torch.device, kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool
) -> AttentionBackend:
    """The backend called `name` ("auto": default_attention_backend) over this pool; `deterministic`
    asks for one arithmetic for prefill and decode, which only cpu_kernels has (its decode kernel)."""
    if name == "auto":
        name = default_attention_backend(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown --attention-backend {name!r} (choose {', '.join(ATTENTION_BACKENDS)})")
    return ATTENTION_BACKENDS[name](kv_pool, req_to_token, deterministic)
