"""The CUDA attention path (flashinfer over the paged pool). Not implemented yet: on CUDA the
torch-native backend runs until it is."""

from __future__ import annotations

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention


class FlashInferAttnBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        raise NotImplementedError(
            "the flashinfer attention backend is not built yet; use --attention-backend torch_native"
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError
