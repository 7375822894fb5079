from __future__ import annotations

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Paged attention for one layer; the math lives in the batch's attention backend."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id  # the layer's index within its pipeline stage: its place in the KV pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        # A token at position p attends to keys p - sliding_window + 1 .. p (transformers' sliding
        # mask, llama.cpp's n_swa); None: to every key before it.
        self.sliding_window = sliding_window
        # Gemma 2: each score s (after scaling) becomes logit_softcap * tanh(s / logit_softcap)
        self.logit_softcap = logit_softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert batch.attn_backend is not None
        return batch.attn_backend.forward(q, k, v, self, batch)
