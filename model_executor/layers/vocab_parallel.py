"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of the TP size and split into equal contiguous ranges;
rank r owns ids [r * per_rank, (r + 1) * per_rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.layers.linear import LinearBase
from model_executor.layers.sharding import TensorSource, check_shape, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    LOAD_ROWS = 8192  # rows read at a time: a 151k x 1536 float32 vocabulary is 0.9 GB at once

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        comm: Communicator,
        *,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        tp = comm.world_size
        self.per_rank = -(-vocab_size // tp)
        self.start = comm.rank_in_group * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)  # real ids owned; the rest is padding
        self.weight = nn.Parameter(
            torch.zeros(self.per_rank, hidden_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        if tuple(loaded.shape)[0] != self.vocab_size or tuple(loaded.shape)[1] != param.shape[1]:
            raise ValueError(
                f"shape mismatch for embedding: model expects ({self.vocab_size}, {param.shape[1]}), "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        rows = self.end - self.start
        with torch.no_grad():
            for first in range(0, rows, self.LOAD_ROWS):  # a float32 checkpoint's vocabulary is big
                length = min(self.LOAD_ROWS, rows - first)
                shard = loaded.narrow(0, self.start + first, length)
                check_shape(param[first : first + length], tuple(shard.shape))
                param[first : first + length].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Projects hidden states to logits. With tied embeddings it shares the embedding's weight.
    Not quantized by --quantization w8a8_int8 (as SGLang and vLLM leave lm_head unquantized by
    default): on SmolLM2, int8 logits agreed with bf16's top-1 on 3 points fewer of 1024 tokens of
    text. --quantization gguf runs it on the file's own Q8_0 values where it holds them so."""

    quantizable = False  # model_executor/cpu/weights.py, pack_model

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        comm: Communicator,
        *,
        params_dtype: torch.dtype = torch.float32,
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, comm, params_dtype=params_dtype)
        if tied_to is not None:
            self.weight = tied_to.weight

    def forward(self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab_size] on every TP rank, in `out_dtype` if given
        (float32: each rank's kernel keeps its sums unrounded, and the gather moves them as they are)."""
        logits = self.comm.all_gather(self.linear_method.apply(self, hidden, None, out_dtype), dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size].contiguous()
