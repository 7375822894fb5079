"""What the ModelRunner needs from a model; every registered model subclasses this."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_executor.distributed.pipeline import StageOutput
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention
from model_executor.layers.layernorm import RMSNorm
from model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_executor.layers.moe import SparseMoeBlock
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.layers.vocab_parallel import VocabParallelEmbedding
from model_executor.models.config_check import ConfigFields, check_config


@dataclass(frozen=True)
class PreNormLayer:
    """One decoder layer of the Llama block, as its modules:

    q, k, v = qkv_proj(input_layernorm(x))          (q_norm / k_norm per head, where set)
    h = x + o_proj(attn(rotary(q), rotary(k), v))
    out = h + down_proj(silu(gate) * up)            gate, up = gate_up_proj(post_attention_layernorm(h))

    or, where `moe` is set, out = h + moe(post_attention_layernorm(h)) (a mixture of experts), the
    dense projections None.
    """

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    qkv_proj: QKVParallelLinear
    o_proj: RowParallelLinear
    gate_up_proj: MergedColumnParallelLinear | None
    down_proj: RowParallelLinear | None
    attn: Attention
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    moe: SparseMoeBlock | None = None


@dataclass(frozen=True)
class DecoderStack:
    """A whole model below its LM head, as modules: what a runner that runs whole layers in one call
    reads (model_executor/cpu/decode_runner.py). The modules themselves, not copies: their weights
    are the ones loaded and packed."""

    embed_tokens: VocabParallelEmbedding
    layers: list[PreNormLayer]
    norm: RMSNorm
    rotary_emb: RotaryEmbedding  # shared by every layer


class CausalLM(nn.Module):
    # checkpoint name part -> (parameter name part, shard id), e.g. q_proj -> (qkv_proj, "q")
    packed_modules_mapping: dict[str, tuple[str, Any]] = {}
    # The architecture-specific config.json fields transformers reads for it (models/config_check.py)
    config_fields = ConfigFields()
    is_causal = True  # False: an encoder (BERT), served only for embeddings (--is-embedding)

    @classmethod
    def check_config(cls, config: Any, context_length: int) -> None:
        """Raises ValueError naming each config.json field whose value asks for math this model does
        not implement (served with `context_length` tokens); called before anything is built."""
        check_config(cls.__name__, cls.config_fields, config, context_length)

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        previous: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        """-> final hidden states [num_tokens, hidden] on the last pipeline stage, the hand-over to
        the next stage on the others (`previous`: what the stage before handed over; None on the
        first). Writes this step's K/V of the stage's layers into the pool."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab], identical on every TP rank."""

    @abstractmethod
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads on this rank, head_dim): the shape of this rank's KV pool per token."""

    def attention_windows(self) -> list[int | None]:
        """Every layer's attention window, on every pipeline stage (None: full attention); empty
        where no layer has one. The KV pool keeps window pages for them (mem_cache/window_pages.py)."""
        return []

    def decoder_stack(self) -> DecoderStack | None:
        """This rank's model as PreNormLayers, or None where its layers are another block or the rank
        holds only part of the model (a pipeline stage)."""
        return None

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors the model knowingly ignores (e.g. rotary inv_freq, a tied lm_head,
        other pipeline stages' layers)."""
        return False

    def rename_checkpoint_tensor(self, name: str) -> str:
        """The parameter a checkpoint tensor loads into, before packed-module mapping (e.g. a
        tied embedding loaded as the LM head of a last pipeline stage)."""
        return name
