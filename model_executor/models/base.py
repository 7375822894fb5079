"""What the ModelRunner needs from a model; every registered model subclasses this."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from model_executor.distributed.pipeline import StageOutput
from model_executor.forward_batch import ForwardBatch


class CausalLM(nn.Module):
    # checkpoint name part -> (parameter name part, shard id), e.g. q_proj -> (qkv_proj, "q")
    packed_modules_mapping: dict[str, tuple[str, Any]] = {}

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                previous: StageOutput | None = None) -> torch.Tensor | StageOutput:
        """-> final hidden states [num_tokens, hidden] on the last pipeline stage, the hand-over to
        the next stage on the others (`previous`: what the stage before handed over; None on the
        first). Writes this step's K/V of the stage's layers into the pool."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab], identical on every TP rank."""

    @abstractmethod
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads on this rank, head_dim): the shape of this rank's KV pool per token."""

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors the model knowingly ignores (e.g. rotary inv_freq, a tied lm_head,
        other pipeline stages' layers)."""
        return False

    def rename_checkpoint_tensor(self, name: str) -> str:
        """The parameter a checkpoint tensor loads into, before packed-module mapping (e.g. a
        tied embedding loaded as the LM head of a last pipeline stage)."""
        return name
