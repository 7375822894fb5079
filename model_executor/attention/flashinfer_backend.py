"""The CUDA attention path: flashinfer's paged kernels over the KV pool, written against
flashinfer-python 0.5.3 (pyproject's `cuda` extra pins it; its wrappers' plan/run signatures).

A layer's K (or V) buffer [num_slots, kv_heads, d] is flashinfer's "NHD" paged layout viewed as
[num_pages, page_size, kv_heads, d], because slot = page * page_size + offset. flashinfer reads a
request's KV as a list of page ids plus how many entries its last page holds:

    page_size 4, seq_len 10, req_to_token[row, :10] = 28 29 30 31 | 8 9 10 11 | 44 45
    kv_indices 7 2 11   kv_last_page_len 2   (kv_indptr: where each request's ids start)

That needs position p of every request at offset p % page_size of its page, which the allocator
guarantees (a request's tokens fill whole pages from position 0; a partial last page is continued
in place; the radix cache shares whole pages only).

flashinfer is imported when the backend is built, never at module import: the CPU path does not
have it.
"""

from __future__ import annotations

from typing import Any

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention

# Split-k partial results; the size flashinfer's docs and SGLang use.
WORKSPACE_BYTES = 128 * 2**20


def qo_indptr(extend_seq_lens: torch.Tensor) -> torch.Tensor:
    """int32 [bs + 1]: where each request's new tokens start in the step's flattened tokens."""
    lens = extend_seq_lens.to(torch.int32)
    return torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0, dtype=torch.int32)])


def paged_kv_metadata(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's page table of each request's first seq_lens[i] positions (see the module's
    diagram): kv_indptr int32 [bs + 1], kv_indices int32 [kv_indptr[-1]] (page ids, request-major),
    kv_last_page_len int32 [bs] in [1, page_size]. Torch ops on req_to_token's device; one host
    sync (the number of pages). Mutates nothing; raises ValueError on page_size < 1 or a
    seq_len < 1."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError(f"every seq_len must be >= 1, got {seq_lens.tolist()}")
    device = req_to_token.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    rows = req_pool_indices.to(device=device, dtype=torch.int64)
    num_pages = (seq_lens + page_size - 1) // page_size
    kv_indptr = torch.cat([num_pages.new_zeros(1), torch.cumsum(num_pages, 0)])
    total = int(kv_indptr[-1])
    req_of_page = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device), num_pages, output_size=total
    )
    page_rank = torch.arange(total, device=device) - kv_indptr[:-1][req_of_page]
    first_slots = req_to_token[rows[req_of_page], page_rank * page_size]
    kv_indices = first_slots // page_size
    kv_last_page_len = seq_lens - (num_pages - 1) * page_size
    return kv_indptr.to(torch.int32), kv_indices.to(torch.int32), kv_last_page_len.to(torch.int32)


class FlashInferAttnBackend(AttentionBackend):
    """Extend: BatchPrefillWithPagedKVCacheWrapper, causal over prefix + new tokens (the new k/v
    are written to the pool first). Decode: BatchDecodeWithPagedKVCacheWrapper. Each step plans
    once, at its first layer (the plan needs the layers' head counts and scale, which the pool
    does not know), and every layer with the same geometry runs on that plan."""

    supports_sliding_window = False

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        import flashinfer  # the CUDA path's own dependency

        if kv_pool.device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend runs on CUDA, got device {kv_pool.device}")
        if kv_pool.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the flashinfer attention backend runs bfloat16 or float16, got {kv_pool.dtype}: "
                "give --dtype bfloat16, or --attention-backend triton or torch_native"
            )
        page_size = getattr(kv_pool, "page_size", None)
        if page_size is None:
            raise ValueError(f"the flashinfer attention backend needs a paged KV pool, got {type(kv_pool)}")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.page_size: int = page_size
        self._flashinfer = flashinfer
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: dict[bool, Any] = {}  # by use_tensor_cores, built on first use
        self._batch: ForwardBatch | None = None
        self._metadata: tuple[torch.Tensor, ...] = ()  # qo_indptr, kv_indptr, kv_indices, kv_last_page_len
        self._planned: tuple[object, ...] | None = None  # what the current plan was made for

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.req_to_token.device
        kv_indptr, kv_indices, kv_last_page_len = paged_kv_metadata(
            self.req_to_token, batch.req_pool_indices, batch.seq_lens, self.page_size
        )
        extend_lens = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int32, device=device)
        self._batch = batch
        self._metadata = (qo_indptr(extend_lens), kv_indptr, kv_indices, kv_last_page_len)
        self._planned = None

    def _wrapper(self, layer: Attention, batch: ForwardBatch, q_dtype: torch.dtype) -> Any:
        """The step's wrapper, planned for this layer's geometry (again only if it differs from
        the previous layer's). Mutates the wrappers' plans."""
        assert batch is self._batch, "init_forward_metadata was not called for this batch"
        qo, kv_indptr, kv_indices, kv_last_page_len = self._metadata
        kv_dtype = self.kv_pool.dtype
        key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling, q_dtype)
        if batch.is_decode:
            # SGLang's rule: the tensor-core (prefill) kernel is faster from 4 query heads per KV head.
            tensor_cores = layer.num_heads // layer.num_kv_heads >= 4
            wrapper = self._decode.get(tensor_cores)
            if wrapper is None:
                wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores
                )
                self._decode[tensor_cores] = wrapper
            if self._planned != key:
                wrapper.plan(
                    kv_indptr,
                    kv_indices,
                    kv_last_page_len,
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_dim,
                    self.page_size,
                    sm_scale=layer.scaling,
                    q_data_type=q_dtype,
                    kv_data_type=kv_dtype,
                )
        else:
            wrapper = self._prefill
            if self._planned != key:
                wrapper.plan(
                    qo,
                    kv_indptr,
                    kv_indices,
                    kv_last_page_len,
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_dim,
                    self.page_size,
                    causal=True,
                    sm_scale=layer.scaling,
                    q_data_type=q_dtype,
                    kv_data_type=kv_dtype,
                )
        self._planned = key
        return wrapper

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        n = q.shape[0]
        # q may be a column slice of one qkv tensor; the kernels want each head's row contiguous.
        q = q.contiguous().view(n, layer.num_heads, layer.head_dim)
        k = k.reshape(n, layer.num_kv_heads, layer.head_dim)
        v = v.reshape(n, layer.num_kv_heads, layer.head_dim)
        self.kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.get_kv_buffer(layer.layer_id)
        paged_shape = (-1, self.page_size, layer.num_kv_heads, layer.head_dim)
        wrapper = self._wrapper(layer, batch, q.dtype)
        out = wrapper.run(q, (k_cache.view(paged_shape), v_cache.view(paged_shape)))
        return out.reshape(n, layer.num_heads * layer.head_dim)
