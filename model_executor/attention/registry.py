"""Attention backends by --attention-backend name."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.attention.torch_native import TorchNativeAttnBackend

logger = logging.getLogger("srt.attention")


def _cpu_kernels(kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool) -> AttentionBackend:
    from model_executor.cpu.attention_backend import CpuKernelsAttnBackend  # the CPU's, in its folder

    return CpuKernelsAttnBackend(kv_pool, req_to_token, deterministic)


def _flashinfer(kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool) -> AttentionBackend:
    from model_executor.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(kv_pool, req_to_token)


def _triton(kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool) -> AttentionBackend:
    from model_executor.attention.triton_backend import TritonAttnBackend  # imports triton

    return TritonAttnBackend(kv_pool, req_to_token)


ATTENTION_BACKENDS: dict[str, Callable[[KVPool, torch.Tensor, bool], AttentionBackend]] = {
    "torch_native": lambda kv_pool, req_to_token, deterministic: TorchNativeAttnBackend(
        kv_pool, req_to_token
    ),
    "cpu_kernels": _cpu_kernels,
    "flashinfer": _flashinfer,
    "triton": _triton,
}


def _importable(module: str) -> bool:
    """Whether `import module` works: a broken install (a missing dependency of its own) counts as
    absent, and says why in the log."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        logger.info("--attention-backend auto: %s not usable here (%s)", module, error)
        return False
    return True


# flashinfer's kernels take 16-bit q/k/v only (0.5.3 has no float32 prefill)
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)


def default_attention_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """--attention-backend auto: our kernels on the CPU (torch SDPA wherever they do not apply); on
    CUDA flashinfer where it imports and takes `dtype`, else a registered triton backend where triton
    imports, else torch SDPA (also on every other device)."""
    if device.type == "cpu":
        return "cpu_kernels"
    if device.type == "cuda":
        if dtype in FLASHINFER_DTYPES and _importable("flashinfer"):
            return "flashinfer"
        if "triton" in ATTENTION_BACKENDS and _importable("triton"):
            return "triton"
    return "torch_native"


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend `name` stands for on `device` for a model in `dtype` ("auto":
    default_attention_backend). Raises ValueError on a name no backend has."""
    if name == "auto":
        name = default_attention_backend(device, dtype)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown --attention-backend {name!r} (choose {', '.join(ATTENTION_BACKENDS)})")
    return name


def create_attention_backend(
    name: str, device: torch.device, kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool
) -> AttentionBackend:
    """The backend called `name` (resolve_attention_backend) over this pool; `deterministic` asks
    for one arithmetic for prefill and decode, which only cpu_kernels has (its decode kernel)."""
    name = resolve_attention_backend(name, device, kv_pool.dtype)
    return ATTENTION_BACKENDS[name](kv_pool, req_to_token, deterministic)
