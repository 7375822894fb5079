from __future__ import annotations

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.fused_ops import fused_ops


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


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """An encoder's attention (BERT's): q, k, v [tokens, heads x head_dim] float32 (the qkv
    projection's sums), each request's tokens attending to all of its own, softmax(q k^T / sqrt(d)) v
    in float32, rounded to `dtype` once. It writes no K/V. In one call where the device has a fused
    op for it (the CPU's, for bf16), else per request in torch (layers/fused_ops.py)."""
    return fused_ops().encoder_attention(q, k, v, lengths, head_dim, dtype)
