"""Llama family (Llama 2/3, SmolLM2, TinyLlama).

Mistral (no attention_bias, a sliding window), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm)
reuse these blocks: AttentionSwitches says how their attention differs, `config_fields` which
config.json fields transformers reads for each (models/config_check.py refuses what srt lacks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage, StageOutput
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention
from model_executor.layers.layernorm import HeadsRMSNorm, RMSNorm
from model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_executor.layers.moe import SparseMoeBlock
from model_executor.layers.rotary import RotaryEmbedding, rope_parameters, rope_permutation, rotary_dim
from model_executor.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from model_executor.loader.load_weights import NamedTensorSource, PermutedRows
from model_executor.models.base import CausalLM, DecoderStack, PreNormLayer
from model_executor.models.config_check import ConfigFields
from model_executor.models.registry import register_model


@dataclass(frozen=True)
class AttentionSwitches:
    """Where an architecture's attention differs from plain Llama's (no biases, no q/k norm)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # a per-head RMSNorm on q and k before rotary
    qk_norm_across_heads: bool = False  # one RMSNorm over all of q's heads, one over k's (OLMoE)


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        comm: Communicator,
        dtype: torch.dtype,
        *,
        switches: AttentionSwitches,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            switches.qkv_bias,
            comm,
            params_dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            switches.o_bias,
            comm,
            params_dtype=dtype,
            what="number of attention heads x head_dim",
        )
        self.head_dim = head_dim
        self.comm = comm
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, params_dtype=dtype) if switches.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, params_dtype=dtype) if switches.qk_norm else None
        self.q_heads_norm: HeadsRMSNorm | None = None
        self.k_heads_norm: HeadsRMSNorm | None = None
        if switches.qk_norm_across_heads:
            qkv, rank = self.qkv_proj, comm.rank_in_group
            self.q_heads_norm = HeadsRMSNorm(
                config.num_attention_heads * head_dim,
                qkv.q_size,
                rank,
                1,
                config.rms_norm_eps,
                params_dtype=dtype,
            )
            self.k_heads_norm = HeadsRMSNorm(
                config.num_key_value_heads * head_dim,
                qkv.kv_size,
                rank // qkv.kv_replicas,
                qkv.kv_replicas,
                config.rms_norm_eps,
                params_dtype=dtype,
            )
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = Attention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scaling=head_dim**-0.5,
            sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        n, q_size, kv_size = hidden.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = self.qkv_proj.split(qkv)
            q = self.q_norm(q.reshape(n, -1, self.head_dim)).view(n, -1)
            k = self.k_norm(k.reshape(n, -1, self.head_dim)).view(n, -1)
            q, k = self.rotary_emb(positions, q, k)
        elif self.q_heads_norm is not None and self.k_heads_norm is not None:
            q, k, v = self.qkv_proj.split(qkv)
            q_norm, k_norm = self.q_heads_norm, self.k_heads_norm
            # one all-reduce for both norms' sums of squares
            sums = self.comm.all_reduce(torch.cat([q_norm.sum_squares(q), k_norm.sum_squares(k)], dim=1))
            q, k = self.rotary_emb(positions, q_norm.scale(q, sums[:, :1]), k_norm.scale(k, sums[:, 1:]))
        else:
            # q and k sit side by side in the qkv output: rotate both heads' sets in one pass.
            qk = self.rotary_emb.rotate(
                positions, qkv[:, : q_size + kv_size].view(n, -1, self.head_dim)
            ).view(n, -1)
            q, k = qk[:, :q_size], qk[:, q_size:]
            v = qkv[:, q_size + kv_size :]
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], False, comm, params_dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, False, comm, params_dtype=dtype, what="intermediate size"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        comm: Communicator,
        dtype: torch.dtype,
        *,
        switches: AttentionSwitches,
        rotary_emb: RotaryEmbedding,
        mlp: nn.Module,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config,
            layer_id,
            comm,
            dtype,
            switches=switches,
            rotary_emb=rotary_emb,
            sliding_window=sliding_window,
        )
        self.mlp = mlp  # LlamaMLP, or a mixture of experts (layers/moe.py): float32 out, all-reduced
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm.start(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def sliding_window_of(fields: ConfigFields, config: Any, layer_id: int) -> int | None:
    """Layer `layer_id`'s attention window as the architecture's transformers code reads it
    (config_check.ConfigFields.sliding_window), or None: full attention."""
    window = getattr(config, "sliding_window", None)
    if not window or fields.sliding_window == "ignored":
        return None
    if fields.sliding_window == "layer_types":
        layer_types = list(getattr(config, "layer_types", None) or [])
        if layer_id >= len(layer_types) or layer_types[layer_id] != "sliding_attention":
            return None
    return int(window)


class MissingLayer(nn.Module):
    """Stands where another pipeline stage's layer is: no parameters, never called."""


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        comm: Communicator,
        dtype: torch.dtype,
        *,
        switches: AttentionSwitches,
        stage: PipelineStage,
        make_mlp: Callable[[int], nn.Module],
        window_of: Callable[[int], int | None] = lambda layer_id: None,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm, params_dtype=dtype)
            if stage.is_first
            else None
        )
        max_position = int(getattr(config, "max_position_embeddings", 4096))
        rotary_emb = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters(config), dtype)
        # Layer i keeps its place (checkpoint names); its KV lives at i - start_layer in this stage's pool.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                i - stage.start_layer,
                comm,
                dtype,
                switches=switches,
                rotary_emb=rotary_emb,
                mlp=make_mlp(i),
                sliding_window=window_of(i),
            )
            if stage.owns_layer(i)
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.local_layers: list[LlamaDecoderLayer] = [
            m for m in self.layers if isinstance(m, LlamaDecoderLayer)
        ]
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=dtype) if stage.is_last else None
        )
        self.rotary_emb = rotary_emb

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        previous: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        """-> final hidden states on the last stage, this stage's output on the others."""
        self.rotary_emb.forget_positions()
        return run_stage(self, input_ids, positions, batch, previous)


def run_stage(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    batch: ForwardBatch,
    previous: StageOutput | None,
    embed_scale: float | None = None,
) -> torch.Tensor | StageOutput:
    """A pipeline stage of `model` (its embed_tokens, local_layers and norm, None where another stage
    has them): the input ids embedded (times `embed_scale`: float32) or `previous`'s hand-over, every
    local layer on the (hidden, residual) pair, then the final norm or the hand-over to the next."""
    residual: torch.Tensor | None = None
    if previous is None:
        assert model.embed_tokens is not None, "only the first pipeline stage embeds the input ids"
        hidden = model.embed_tokens(input_ids)
        if embed_scale is not None:
            hidden = hidden.float() * embed_scale
    else:
        hidden, residual = previous.hidden, previous.residual
    for layer in model.local_layers:
        hidden, residual = layer(positions, hidden, residual, batch)
    if model.norm is None:
        assert residual is not None
        return StageOutput(hidden, residual)
    hidden, _ = model.norm(hidden, residual)
    return hidden


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    qkv_bias = False  # True: q/k/v biases whatever attention_bias says (Qwen2)
    qk_norm = False
    qk_norm_across_heads = False
    rope_interleaved = False  # True: transformers rotates pairs (2i, 2i + 1) of each head (GLM-4)
    config_fields = ConfigFields(attention_bias=True, mlp_bias=True)
    # checkpoint name part -> (parameter name part, shard id)
    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.stage = stage = stage or PipelineStage()
        head_dim = head_dim_of(config)
        # each head's q and k rows in srt's rotary layout (partial or interleaved rotary), or None
        self._rope_order = rope_permutation(
            head_dim, rotary_dim(head_dim, rope_parameters(config)), self.rope_interleaved
        )
        self.model = self.build_model(config, comm, dtype, stage)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A last stage that is not also the first has no embedding to share: its head loads a copy.
        self.lm_head = (
            ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                comm,
                params_dtype=dtype,
                tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
            )
            if stage.is_last
            else None
        )

    def build_model(self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage) -> Any:
        """The model below the LM head (`model.` in checkpoint names): embed_tokens, local_layers
        and norm where the stage has them."""
        return LlamaModel(
            config,
            comm,
            dtype,
            switches=self.attention_switches(config),
            stage=stage,
            make_mlp=lambda layer_id: self.make_mlp(config, layer_id, comm, dtype),
            window_of=lambda layer_id: sliding_window_of(self.config_fields, config, layer_id),
        )

    def attention_switches(self, config: Any) -> AttentionSwitches:
        attention_bias = self.config_fields.attention_bias and bool(getattr(config, "attention_bias", False))
        return AttentionSwitches(
            self.qkv_bias or attention_bias, attention_bias, self.qk_norm, self.qk_norm_across_heads
        )

    def make_mlp(self, config: Any, layer_id: int, comm: Communicator, dtype: torch.dtype) -> nn.Module:
        """Layer `layer_id`'s MLP (a mixture-of-experts model's sparse block where it has one)."""
        return LlamaMLP(config, comm, dtype)

    def attention_windows(self) -> list[int | None]:
        return [
            sliding_window_of(self.config_fields, self.config, i)
            for i in range(self.config.num_hidden_layers)
        ]

    def decoder_stack(self) -> DecoderStack | None:
        model = self.model
        if model.embed_tokens is None or model.norm is None:  # a pipeline stage
            return None
        layers = []
        for layer in model.local_layers:
            mlp, attn = layer.mlp, layer.self_attn
            dense = mlp if isinstance(mlp, LlamaMLP) else None
            moe = mlp if isinstance(mlp, SparseMoeBlock) else None
            if (dense is None and moe is None) or attn.q_heads_norm is not None:
                return None  # norms across heads: the fused decode layer has none
            layers.append(
                PreNormLayer(
                    layer.input_layernorm,
                    layer.post_attention_layernorm,
                    attn.qkv_proj,
                    attn.o_proj,
                    None if dense is None else dense.gate_up_proj,
                    None if dense is None else dense.down_proj,
                    attn.attn,
                    attn.q_norm,
                    attn.k_norm,
                    moe,
                )
            )
        return DecoderStack(model.embed_tokens, layers, model.norm, model.rotary_emb)

    def split_checkpoint_tensor(self, tensor: NamedTensorSource) -> list[NamedTensorSource]:
        """The parts of a tensor the checkpoint stores fused (split_fused), q's and k's rows
        reordered head by head where transformers' rotary layout is not srt's (layers/rotary.py
        rope_permutation: a partial or interleaved rotary). Whole heads move together, so tensor
        parallelism's shards of heads hold the same heads' rows."""
        return [self._rope_layout(part) for part in self.split_fused(tensor)]

    def split_fused(self, tensor: NamedTensorSource) -> list[NamedTensorSource]:
        return [tensor]

    def _rope_layout(self, tensor: NamedTensorSource) -> NamedTensorSource:
        order = self._rope_order
        prefix = tensor.name.rpartition(".")[0]
        if order is None or not prefix.endswith((".self_attn.q_proj", ".self_attn.k_proj")):
            return tensor
        head_dim = len(order)
        heads = int(tuple(tensor.shape)[0]) // head_dim
        return PermutedRows(tensor, (order + head_dim * torch.arange(heads)[:, None]).flatten())

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Rotary caches, a tied head's own copy, and whatever other pipeline stages own."""
        if "rotary_emb.inv_freq" in name:
            return True
        if name.startswith("model.layers."):
            return not self.stage.owns_layer(int(name.split(".")[2]))
        if name.startswith("model.embed_tokens."):
            return not (self.stage.is_first or self._head_loads_embedding)
        if name.startswith("model.norm."):
            return not self.stage.is_last
        if name.startswith("lm_head."):
            return not self.stage.is_last or self.tie_word_embeddings
        return False

    @property
    def _head_loads_embedding(self) -> bool:
        return self.tie_word_embeddings and self.stage.is_last and not self.stage.is_first

    def rename_checkpoint_tensor(self, name: str) -> str:
        if self._head_loads_embedding and name == "model.embed_tokens.weight":
            return "lm_head.weight"
        if self.qk_norm_across_heads:  # q_norm / k_norm span all heads: HeadsRMSNorm
            name = name.replace(".self_attn.q_norm.", ".self_attn.q_heads_norm.")
            name = name.replace(".self_attn.k_norm.", ".self_attn.k_heads_norm.")
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        previous: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        return self.model(input_ids, positions, batch, previous)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden, out_dtype=torch.float32)

    def kv_cache_layout(self) -> tuple[int, int, int]:
        qkv = self.model.local_layers[0].self_attn.qkv_proj
        return len(self.model.local_layers), qkv.num_kv_heads, qkv.head_dim
