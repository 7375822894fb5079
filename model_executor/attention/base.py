"""The attention backend interface: one object per ModelRunner, shared by every layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_executor.forward_batch import ForwardBatch
    from model_executor.layers.attention import Attention


class AttentionBackend(ABC):
    """Writes each step's new K/V into the paged pool and attends over prefix + new tokens."""

    # True where a prefill runs every new token on the decode path's arithmetic, so that a token's
    # bits do not depend on how it was computed (deterministic inference, on the cpu_kernels backend)
    decode_rows_extend: bool = False
    # True where the decode path reads only the batch's device tensors (no *_cpu lists, no host sync), so a CUDA graph captured over it replays for any lengths
    supports_cuda_graph: bool = False
    # Whether layers with a sliding window (Attention.sliding_window) attend within it here
    supports_sliding_window: bool = True

    def use_window_pages(self, req_to_token: torch.Tensor) -> None:
        """Gives the local layers' request table (window slots, mem_cache/window_pages.py): the layers
        in the pool's `window_layers` read through it and write at `batch.window_cache_loc`. Raises
        ValueError where the backend keeps none."""
        raise ValueError(f"{type(self).__name__} has no window pages (--disable-hybrid-swa-memory)")

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Builds per-step index tensors shared by every layer (called once per forward).
        Mutates only the backend's own metadata."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [n, heads*d], k/v [n, kv_heads*d] for the batch's new tokens -> [n, heads*d].

        Mutates the KV pool: writes k/v at `batch.out_cache_loc` for `layer.layer_id`.
        """
