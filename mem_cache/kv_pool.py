"""KV cache storage: per-layer key and value buffers indexed by slot.

A slot is one token position in the pool: `slot = page * page_size + offset`. Which slots a
request owns is decided by `PageAllocator` and recorded in `ReqToTokenPool.req_to_token`; the
pool only stores tensors and knows nothing about requests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from abc import ABC, abstractmethod

import torch

_MADV_DONTNEED = 4  # Linux


@functools.cache
def _madvise() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


# Float8 tensors are stored as uint8 and viewed back on read: index_put/index_copy for float8 is
# not implemented on every backend, while a byte copy always is.
_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


class KVPool(ABC):
    """Storage for every layer's K and V, `num_slots` token positions each.

    Implementations hold no locks: the scheduler and model runner of a rank use a pool from one
    thread.
    """

    num_slots: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    window_layers: frozenset[int] = frozenset()  # layers whose K/V lives in window pages

    @abstractmethod
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return layer `layer_id`'s (K, V) buffers, each [num_slots, num_kv_heads, head_dim] (a
        PagedKVPool's padding page, if it has one, past those).

        Mutates nothing; the tensors are views of the pool, so writing to them writes the pool.
        Raises ValueError if `layer_id` is out of range.
        """

    @abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k[i]`, `v[i]` (cast to the pool dtype) into slot `loc[i]` of layer `layer_id`.

        Mutates only those rows of that layer's K and V buffers. `loc` is int64 [N]; `k`, `v` are
        [N, num_kv_heads, head_dim]. Raises ValueError if `layer_id` is out of range; torch raises
        RuntimeError on a shape mismatch or an out-of-range slot.
        """

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes of K plus V over all layers for one slot."""

    @property
    def total_bytes(self) -> int:
        """Bytes of all K and V buffers."""
        return sum(k.nbytes + v.nbytes for k, v in map(self.get_kv_buffer, range(self.num_layers)))


class PagedKVPool(KVPool):
    """K and V buffers of `num_pages * page_size` slots per layer.

    Every page is usable, page 0 included: nothing here relies on a reserved "null" slot. With
    `padding_page` the buffers hold one more page past `num_pages`, which no allocator of
    `num_pages` hands out: the padding rows of a CUDA graph's batch write there
    (`padding_slot`, model_executor/cuda/graph_plan.py).
    Buffers come from `torch.empty`, so on CPU the pages no request has touched yet are not
    resident memory.

    The layers in `window_layers` (local layers whose K/V lives in window pages,
    mem_cache/window_pages.py) hold `window_pages` pages instead, and one zeroed null page past them.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        *,
        padding_page: bool = False,
        window_layers: frozenset[int] = frozenset(),
        window_pages: int = 0,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._store_dtype = torch.uint8 if dtype in _FLOAT8_DTYPES else dtype
        # the first slot past the pages requests own; None without a padding page
        self.padding_slot: int | None = self.num_slots if padding_page else None
        if window_layers and (window_pages < 1 or padding_page):
            raise ValueError("window layers need window_pages >= 1 and no padding page")
        self.window_layers = window_layers
        self.window_pages = window_pages
        shape = (self.num_slots + (page_size if padding_page else 0), num_kv_heads, head_dim)
        window_shape = ((window_pages + 1) * page_size, num_kv_heads, head_dim)
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        for layer in range(num_layers):
            for buffers in (self.k_buffer, self.v_buffer):
                if layer in window_layers:
                    buffer = torch.empty(window_shape, dtype=self._store_dtype, device=self.device)
                    buffer[window_pages * page_size :] = 0  # the null page
                else:
                    buffer = torch.empty(shape, dtype=self._store_dtype, device=self.device)
                buffers.append(buffer)

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id must be in [0, {self.num_layers}), got {layer_id}")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer_id)
        k, v = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if self._store_dtype != self.dtype:
            return k.view(self.dtype), v.view(self.dtype)
        return k, v

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_layer(layer_id)
        k, v = k.to(self.dtype), v.to(self.dtype)
        if self._store_dtype != self.dtype:
            k, v = k.view(self._store_dtype), v.view(self._store_dtype)
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V over the layers of full pages (all but `window_layers`) for one slot."""
        layers = self.num_layers - len(self.window_layers)
        return 2 * layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def release_pages(self, pages: torch.Tensor, window_pages: torch.Tensor | None = None) -> int:
        """Give the host memory under free `pages` (and free `window_pages`, in the window layers)
        back to the OS: madvise(MADV_DONTNEED) on the whole OS pages inside each run of consecutive
        KV pages, in every layer's K and V. Returns the bytes released (0 off CPU or without madvise).

        Mutates those slots' contents (they read as zeros afterwards, and are resident again once
        written): pass only pages no request or cache entry holds. Changes no bookkeeping, so a
        call can never change what a rank schedules.
        """

        def buffers(window: bool) -> list[torch.Tensor]:
            return [
                buffer
                for i in range(self.num_layers)
                if (i in self.window_layers) == window
                for buffer in (self.k_buffer[i], self.v_buffer[i])
            ]

        released = self._release(buffers(False), pages)
        if window_pages is not None:
            released += self._release(buffers(True), window_pages)
        return released

    def _release(self, buffers: list[torch.Tensor], pages: torch.Tensor) -> int:
        madvise = _madvise()
        if self.device.type != "cpu" or madvise is None or pages.numel() == 0 or not buffers:
            return 0
        ids = torch.sort(pages.reshape(-1).to(torch.int64)).values
        breaks = torch.nonzero(ids[1:] - ids[:-1] != 1).reshape(-1) + 1
        starts = torch.cat([ids[:1], ids[breaks]]).tolist()
        ends = (torch.cat([ids[breaks - 1], ids[-1:]]) + 1).tolist()
        slot_bytes = self.num_kv_heads * self.head_dim * self.dtype.itemsize
        run_bytes = self.page_size * slot_bytes
        os_page = mmap.PAGESIZE
        runs = [
            (a * run_bytes, b * run_bytes) for a, b in zip(starts, ends) if (b - a) * run_bytes >= 2 * os_page
        ]
        released = 0
        for buffer in buffers:
            base = buffer.data_ptr()
            for lo, hi in runs:
                first = -(-(base + lo) // os_page) * os_page
                last = (base + hi) // os_page * os_page
                if last > first and madvise(first, last - first, _MADV_DONTNEED) == 0:  # type: ignore[operator]
                    released += last - first
        return released
