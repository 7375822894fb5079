"""Attention with our Triton kernels (triton_kernels.py) over the paged KV pool: the GPU path.

Same semantics as the torch-native backend. Decode is safe to capture in a CUDA graph: it reads
only the batch's device tensors (req_pool_indices, seq_lens, out_cache_loc), never a *_cpu list,
syncs nothing with the host and writes its split-KV partials into scratch allocated once, for
up to `max_batch_size` requests (a row of req_to_token each), so a captured step replays for any
sequence lengths. Extend builds its per-request index tensors from the *_cpu lists.
"""

from __future__ import annotations

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention import triton_kernels
from model_executor.attention.base import AttentionBackend
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention


class TritonAttnBackend(AttentionBackend):
    supports_sliding_window = False
    supports_cuda_graph = True

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, num_kv_splits: int = 8) -> None:
        if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_kv_splits = num_kv_splits
        self.max_batch_size = req_to_token.shape[0]
        # Decode scratch, one pair per (heads, head_dim) seen; allocated by the first decode step
        # of that shape, before any capture replays it, and never resized.
        self._decode_scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Extend metadata, built from the batch's *_cpu lists.
        self._qo_indptr: torch.Tensor | None = None
        self._prefix_lens: torch.Tensor | None = None
        self._extend_lens: torch.Tensor | None = None
        self._max_extend_len = 0

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            return  # decode reads the batch's device tensors directly
        device = self.req_to_token.device
        lens = batch.extend_seq_lens_cpu
        indptr = [0]
        for n in lens[:-1]:
            indptr.append(indptr[-1] + n)
        self._qo_indptr = torch.tensor(indptr, dtype=torch.int64, device=device)
        self._prefix_lens = torch.tensor(batch.extend_prefix_lens_cpu, dtype=torch.int64, device=device)
        self._extend_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        self._max_extend_len = max(lens)

    def decode_scratch(self, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 split-KV partials: outputs [max_batch_size, heads, splits, head_dim] and
        log-sum-exps [max_batch_size, heads, splits]. Allocates them on the first call for a shape."""
        key = (num_heads, head_dim)
        if key not in self._decode_scratch:
            device = self.req_to_token.device
            shape = (self.max_batch_size, num_heads, self.num_kv_splits)
            self._decode_scratch[key] = (
                torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
            )
        return self._decode_scratch[key]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        triton_kernels.check_head_dim(layer.head_dim)
        if layer.num_heads % layer.num_kv_heads:
            raise ValueError(
                f"num_heads ({layer.num_heads}) must be a multiple of num_kv_heads ({layer.num_kv_heads})"
            )
        n = q.shape[0]
        q = q.reshape(n, layer.num_heads, layer.head_dim)
        k = k.reshape(n, layer.num_kv_heads, layer.head_dim)
        v = v.reshape(n, layer.num_kv_heads, layer.head_dim)
        self.kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_pool.get_kv_buffer(layer.layer_id)
        out = torch.empty_like(q)
        if batch.is_decode:
            assert n <= self.max_batch_size, (n, self.max_batch_size)
            mid_o, mid_lse = self.decode_scratch(layer.num_heads, layer.head_dim)
            triton_kernels.decode_attention(
                q,
                k_cache,
                v_cache,
                out,
                self.req_to_token,
                batch.req_pool_indices,
                batch.seq_lens,
                mid_o,
                mid_lse,
                layer.scaling,
            )
        else:
            assert self._qo_indptr is not None and self._prefix_lens is not None
            assert self._extend_lens is not None
            triton_kernels.extend_attention(
                q,
                k_cache,
                v_cache,
                out,
                self.req_to_token,
                batch.req_pool_indices,
                self._qo_indptr,
                self._prefix_lens,
                self._extend_lens,
                self._max_extend_len,
                layer.scaling,
            )
        return out.reshape(n, layer.num_heads * layer.head_dim)
