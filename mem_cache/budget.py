"""How many KV pages fit: sizing the pool from free memory, the same on every rank.

Measured after the weights are loaded (SGLang's semantics for `--mem-fraction-static`):

    reserved       = total_memory * (1 - mem_fraction_static)     # activations, graphs, other users
    kv_bytes       = (free_memory - reserved) // local_world_size # ranks on this host share it
    num_pages      = kv_bytes // (bytes_per_token * page_size)
    num_pages      = min(num_pages, max_total_tokens // page_size)  # when --max-total-tokens is given
    num_pages      = MIN over all ranks (gloo all-reduce on cpu_group)

On CPU, free/total memory are the host's (psutil); on CUDA, the device's (cudaMemGetInfo), and
`local_world_size` should then count the ranks that share one device (normally 1).
"""

from __future__ import annotations

import psutil
import torch
import torch.distributed as dist


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K plus V, over all layers, for one token. Raises ValueError on a size < 1."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def free_memory_bytes(device: str | torch.device) -> int:
    """Memory free for new allocations now: host RAM available on CPU, device memory on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def total_memory_bytes(device: str | torch.device) -> int:
    """Total memory: host RAM on CPU, device memory on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(psutil.virtual_memory().total)


def profile_num_pages(
    *,
    device: str | torch.device,
    mem_fraction_static: float,
    bytes_per_token: int,
    page_size: int,
    local_world_size: int = 1,
    max_total_tokens: int | None = None,
    free_memory: int | None = None,
    total_memory: int | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    min_pages: int = 1,
) -> int:
    """Number of KV pages this rank may allocate; the same value on every rank of `cpu_group`.

    `free_memory`/`total_memory` override the measured values (tests). Collective: when
    `cpu_group` has more than one rank, every rank must call this. Raises ValueError on bad
    arguments, and (on every rank alike, after the all-reduce) when fewer than `min_pages` fit.
    """
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(
            f"mem_fraction_static (--mem-fraction-static) must be in (0, 1], got {mem_fraction_static}"
        )
    for name, value in (
        ("bytes_per_token", bytes_per_token),
        ("page_size", page_size),
        ("local_world_size", local_world_size),
        ("min_pages", min_pages),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_total_tokens is not None and max_total_tokens < 1:
        raise ValueError(f"max_total_tokens (--max-total-tokens) must be >= 1, got {max_total_tokens}")
    free = free_memory_bytes(device) if free_memory is None else free_memory
    total = total_memory_bytes(device) if total_memory is None else total_memory
    reserved = int(total * (1.0 - mem_fraction_static))
    kv_bytes = max(free - reserved, 0) // local_world_size
    num_pages = kv_bytes // (bytes_per_token * page_size)
    if max_total_tokens is not None:
        num_pages = min(num_pages, max_total_tokens // page_size)
    local_pages = num_pages
    if cpu_group is not None and dist.get_world_size(cpu_group) > 1:
        count = torch.tensor([num_pages], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=cpu_group)
        num_pages = int(count.item())
    if num_pages < min_pages:
        raise ValueError(
            f"KV cache too small: {num_pages} page(s) of {page_size} token(s) fit, need at least {min_pages} "
            f"(this rank: {local_pages} page(s); free memory {free} B, reserved {reserved} B = total {total} B "
            f"* (1 - --mem-fraction-static {mem_fraction_static}), shared by {local_world_size} local rank(s), "
            f"{bytes_per_token} B per token; --max-total-tokens {max_total_tokens}). "
            "Raise --mem-fraction-static, free memory, use a smaller model or KV dtype, "
            "or raise --max-total-tokens if it is the limit."
        )
    return num_pages
