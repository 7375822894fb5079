"""How many KV pages fit: the KV budget, the same on every rank.

Each bound is a number of pages; the budget is the smallest that applies, MIN-all-reduced over
the ranks (gloo on `cpu_group`) so that every rank sizes its pool alike:

    memory     (free - total * (1 - mem_fraction_static)) // local_world_size   # SGLang's semantics:
                                           # measured after the weights; device memory on CUDA, host RAM on CPU
    tokens     --max-total-tokens                                     # when given
    space      --cpu-kvcache-space GiB // local_world_size            # CPU, unless --mem-fraction-static or
    requests   --max-running-requests x context length                #   --max-total-tokens alone is given

On CPU the pool is not a device's memory but the host's, shared with everything else on it, so
the default is a fixed space (vLLM's CPU backend: 4 GiB) or what the running requests can hold,
whichever is smaller; the memory bound (0.8 of the host unless told) only keeps that from
overcommitting a small host. `--mem-fraction-static` or `--max-total-tokens` given alone keep
SGLang's meaning; given beside them, `--cpu-kvcache-space` still applies. CUDA uses the memory
and token bounds only. `local_world_size` counts the ranks of this server on the host (they
share the space).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from srt.server_args import DEFAULT_CPU_KVCACHE_SPACE_GIB, DEFAULT_MEM_FRACTION_STATIC

GIB = 1 << 30


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


@dataclass(frozen=True)
class KVBudget:
    """The pool size every rank agreed on, and what set it (for the start-up line)."""

    num_pages: int
    page_size: int
    bytes_per_token: int
    bound: str  # the bound that won, in words with its numbers
    flag: str  # the flag that changes it
    local_world_size: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def describe(self) -> str:
        ranks = f" per rank, {self.local_world_size} ranks on this host" if self.local_world_size > 1 else ""
        return (
            f"KV cache budget: {self.num_bytes / GIB:.3g} GiB = {self.num_tokens} tokens{ranks} "
            f"({self.num_pages} pages of {self.page_size}, {self.bytes_per_token} B per token); "
            f"bound by {self.bound}; change it with {self.flag}"
        )


@dataclass(frozen=True)
class _Bound:
    pages: int
    what: str
    flag: str


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _check_arguments(
    mem_fraction_static: float | None,
    max_total_tokens: int | None,
    cpu_kvcache_space: float | None,
    **at_least_one: int,
) -> None:
    """Raises ValueError naming the first argument of kv_budget out of its range."""
    if mem_fraction_static is not None and not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(
            f"mem_fraction_static (--mem-fraction-static) must be in (0, 1], got {mem_fraction_static}"
        )
    for name, value in at_least_one.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_total_tokens is not None and max_total_tokens < 1:
        raise ValueError(f"max_total_tokens (--max-total-tokens) must be >= 1, got {max_total_tokens}")
    if cpu_kvcache_space is not None and not cpu_kvcache_space > 0:
        raise ValueError(f"cpu_kvcache_space (--cpu-kvcache-space) must be > 0 GiB, got {cpu_kvcache_space}")


def kv_budget(
    *,
    device: str | torch.device,
    bytes_per_token: int,
    page_size: int,
    local_world_size: int = 1,
    mem_fraction_static: float | None = None,
    max_total_tokens: int | None = None,
    cpu_kvcache_space: float | None = None,
    max_running_requests: int | None = None,
    context_length: int | None = None,
    free_memory: int | None = None,
    total_memory: int | None = None,
    cpu_group: dist.ProcessGroup | None = None,
    min_pages: int = 1,
    padding_pages: int = 0,
) -> KVBudget:
    """The KV budget of this rank, equal on every rank of `cpu_group` (the module doc has the rule).

    None means "not given" for `mem_fraction_static`, `max_total_tokens`, `cpu_kvcache_space`
    (GiB; the default space then applies on CPU). `free_memory`/`total_memory` override the
    measured values (tests). `padding_pages`: pages the pool holds past the budget for the device's
    own use (a CUDA graph's padding page), taken out of the memory bound. Collective: with more
    than one rank in `cpu_group` every rank must call this. Raises ValueError on bad arguments, and (on every rank alike, after the
    all-reduce) when fewer than `min_pages` fit.
    """
    _check_arguments(
        mem_fraction_static,
        max_total_tokens,
        cpu_kvcache_space,
        bytes_per_token=bytes_per_token,
        page_size=page_size,
        local_world_size=local_world_size,
        min_pages=min_pages,
    )
    on_cpu = torch.device(device).type == "cpu"
    page_bytes = bytes_per_token * page_size
    shared = f" / {local_world_size} local ranks" if local_world_size > 1 else ""

    free = free_memory_bytes(device) if free_memory is None else free_memory
    total = total_memory_bytes(device) if total_memory is None else total_memory
    fraction = DEFAULT_MEM_FRACTION_STATIC if mem_fraction_static is None else mem_fraction_static
    reserved = int(total * (1.0 - fraction))
    memory = "host RAM" if on_cpu else "device memory"
    bounds = [
        _Bound(
            max(max(free - reserved, 0) // local_world_size // page_bytes - padding_pages, 0),
            f"{memory}: {_gib(free)} free - {_gib(reserved)} reserved (1 - --mem-fraction-static "
            f"{fraction:g} of {_gib(total)}){shared}"
            + (f", less {padding_pages} padding page(s)" if padding_pages else ""),
            "--mem-fraction-static",
        )
    ]
    if max_total_tokens is not None:
        bounds.append(
            _Bound(
                max_total_tokens // page_size, f"--max-total-tokens {max_total_tokens}", "--max-total-tokens"
            )
        )
    explicit = mem_fraction_static is not None or max_total_tokens is not None
    if on_cpu and (cpu_kvcache_space is not None or not explicit):
        space = DEFAULT_CPU_KVCACHE_SPACE_GIB if cpu_kvcache_space is None else cpu_kvcache_space
        default = " (the default)" if cpu_kvcache_space is None else ""
        bounds.append(
            _Bound(
                int(space * GIB) // local_world_size // page_bytes,
                f"--cpu-kvcache-space {space:g} GiB{default}{shared}",
                "--cpu-kvcache-space",
            )
        )
        if max_running_requests is not None and context_length is not None and not explicit:
            per_request = -(-context_length // page_size)
            bounds.append(
                _Bound(
                    max_running_requests * per_request,
                    f"--max-running-requests {max_running_requests} x context length {context_length}",
                    "--max-running-requests or --context-length",
                )
            )
    best = min(bounds, key=lambda b: b.pages)  # the first of equals: the order above
    num_pages = best.pages
    bound, flag = best.what, best.flag
    if cpu_group is not None and dist.get_world_size(cpu_group) > 1:
        count = torch.tensor([num_pages], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=cpu_group)
        if int(count.item()) < num_pages:
            bound = f"another rank's budget (this rank's: {num_pages} pages, by {bound})"
        num_pages = int(count.item())
    if num_pages < min_pages:
        raise ValueError(
            f"KV cache too small: {num_pages} page(s) of {page_size} token(s) fit, need at least {min_pages} "
            f"({bytes_per_token} B per token), bound by {bound}; free memory {free} B, total {total} B. "
            f"Raise {flag}, free memory, use a smaller model or KV dtype, "
            "or give --max-total-tokens / --cpu-kvcache-space if they are the limit."
        )
    return KVBudget(num_pages, page_size, bytes_per_token, bound, flag, local_world_size)


def profile_num_pages(*, mem_fraction_static: float, **kwargs: object) -> int:
    """The pages SGLang's `--mem-fraction-static` rule gives (with `max_total_tokens` as a cap):
    kv_budget with the fraction given, so the CPU space does not apply."""
    return kv_budget(mem_fraction_static=mem_fraction_static, **kwargs).num_pages  # type: ignore[arg-type]
