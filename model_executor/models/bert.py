"""BERT encoders (sentence-transformers' all-MiniLM-L6-v2 and its family), for `--is-embedding`.

    h = LayerNorm(word[id] + position[pos] + token_type[0])
    per layer:  h = LayerNorm(h + dense(attn(q, k, v)))       bidirectional attention within a request
                h = LayerNorm(h + output(gelu(intermediate(h))))

Every token attends to every token of its own request, so a request's prompt runs in one step,
whole (the embedding server turns chunked prefill and the prefix cache off: srt/server_args.py);
attention runs in torch on the step's tokens and writes no K/V. q/k/v, the attention's dense and
the MLP are split over TP ranks as Llama's are (one all-reduce each for the attention and the MLP);
the residual stream and the LayerNorms are float32. No LM head: the runner pools the final hidden
states (model_executor/pooler.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.distributed.pipeline import PipelineStage, StageOutput
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.activation import gelu_erf
from model_executor.layers.attention import encoder_attention
from model_executor.layers.layernorm import LayerNorm
from model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model_executor.layers.vocab_parallel import VocabParallelEmbedding
from model_executor.models.base import CausalLM
from model_executor.models.registry import register_model

# config.json fields of transformers' modeling_bert.py whose values srt does not implement
_REFUSED_UNLESS = {
    "position_embedding_type": ("absolute", "relative position embeddings"),
    "hidden_act": ("gelu", "the MLP's activation; srt computes the exact (erf) GELU"),
    "is_decoder": (False, "causal self-attention"),
    "add_cross_attention": (False, "cross-attention to an encoder"),
}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, comm, params_dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype)
        for table in (self.position_embeddings, self.token_type_embeddings):
            table.weight.requires_grad_(False)
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first layer's input in float32, the same in the model's dtype)."""
        # token type 0 throughout unless given: srt embeds one text per input, as sentence-transformers does
        types = (
            self.token_type_embeddings.weight[0].float()
            if token_types is None
            else self.token_type_embeddings(token_types).float()
        )
        summed = self.word_embeddings(input_ids).float() + self.position_embeddings(positions).float() + types
        return self.LayerNorm(summed, None, self.position_embeddings.weight.dtype)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, heads, True, comm, params_dtype=dtype
        )

    def forward(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """hidden [tokens, hidden] in the model's dtype -> this rank's heads' attention output
        [tokens, heads x head_dim], each request's tokens attending to all of its own (float32),
        rounded to the model's dtype once."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden, torch.float32))
        return encoder_attention(q, k, v, lengths, self.head_dim, hidden.dtype)


class BertAttention(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, comm, dtype)
        self.output = BertOutput(config.hidden_size, config, comm, dtype, what="number of attention heads")

    def forward(
        self, hidden: tuple[torch.Tensor, torch.Tensor], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32, the model's dtype) -> the same of LayerNorm(hidden + dense(attention))."""
        return self.output(self.self(hidden[1], lengths), hidden[0])


class BertOutput(nn.Module):
    """dense (row-parallel, float32 sum), then LayerNorm of the residual plus it: (float32, the
    model's dtype)."""

    def __init__(self, size: int, config: Any, comm: Communicator, dtype: torch.dtype, what: str) -> None:
        super().__init__()
        self.dense = RowParallelLinear(size, config.hidden_size, True, comm, params_dtype=dtype, what=what)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.dense.weight.dtype
        return self.LayerNorm(self.dense(x.to(dtype)), residual, dtype)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, True, comm, params_dtype=dtype
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, hidden] in the model's dtype -> gelu(dense(hidden)) of the dense's float32
        sums, in the model's dtype."""
        return gelu_erf(self.dense(hidden, torch.float32), hidden.dtype)


class BertLayer(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(config, comm, dtype)
        self.intermediate = BertIntermediate(config, comm, dtype)
        self.output = BertOutput(config.intermediate_size, config, comm, dtype, what="intermediate size")

    def forward(
        self, hidden: tuple[torch.Tensor, torch.Tensor], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: (float32, the same in the model's dtype), as the LayerNorms give both."""
        hidden = self.attention(hidden, lengths)
        return self.output(self.intermediate(hidden[1]), hidden[0])


class BertEncoder(nn.Module):
    def __init__(self, config: Any, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, comm, dtype) for _ in range(config.num_hidden_layers))


@register_model("BertModel")
class BertModel(CausalLM):
    """An encoder: forward gives the final hidden states; it has no logits."""

    packed_modules_mapping: dict[str, tuple[str, object]] = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }
    is_causal = False

    def __init__(
        self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage | None = None
    ) -> None:
        super().__init__()
        if stage is not None and stage.size > 1:
            raise ValueError("a BERT encoder runs with --pp-size 1")
        self.config = config
        self.embeddings = BertEmbeddings(config, comm, dtype)
        self.encoder = BertEncoder(config, comm, dtype)

    @classmethod
    def check_config(cls, config: Any, context_length: int) -> None:
        refused = [
            f"{name}={getattr(config, name)!r} ({what})"
            for name, (wanted, what) in _REFUSED_UNLESS.items()
            if getattr(config, name, wanted) != wanted
        ]
        if refused:
            raise ValueError(f"config.json: {', '.join(refused)} not implemented by srt for BertModel")

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """The [CLS] pooler (sentence-transformers pools the hidden states itself) and the
        position-id buffer."""
        return name.startswith("pooler.") or name == "embeddings.position_ids"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        previous: StageOutput | None = None,
    ) -> torch.Tensor | StageOutput:
        assert not any(batch.extend_prefix_lens_cpu), (
            "an encoder runs each prompt whole, without a cached prefix"
        )
        hidden = self.embeddings(input_ids, positions, self.token_types(input_ids, batch.extend_seq_lens_cpu))
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch.extend_seq_lens_cpu)
        return hidden[0]

    def token_types(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor | None:
        """None: every token is of type 0 (one text per input)."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("a BERT encoder has no LM head: it serves embeddings (--is-embedding)")

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """An encoder keeps no K/V; the pool it is given is one slot wide per token (the scheduler
        still hands every token a slot)."""
        return 1, 1, 1


# sentence-transformers' CrossEncoder activations srt applies to a cross-encoder's scores (its
# config.json's sentence_transformers.activation_fn, or sbert_ce_default_activation_function)
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
}


@register_model("BertForSequenceClassification")
class BertForSequenceClassification(BertModel):
    """A cross-encoder (a reranker): BERT over a query and a document as one pair, `[CLS] query [SEP]
    document [SEP]`, the document's tokens of type 1; its score is classifier(tanh(pooler([CLS]))),
    through the activation its sentence-transformers config names (none by default, as SGLang).
    A pair's token types follow its first [SEP]: the front end builds pairs whose query holds none
    (srt/rerank_api.py). pool() replaces the runner's pooling."""

    def __init__(
        self, config: Any, comm: Communicator, dtype: torch.dtype, stage: PipelineStage | None = None
    ) -> None:
        super().__init__(config, comm, dtype, stage)
        hidden = config.hidden_size
        self.pooler = nn.Linear(hidden, hidden, dtype=torch.float32)
        self.classifier = nn.Linear(hidden, config.num_labels, dtype=torch.float32)
        for param in (*self.pooler.parameters(), *self.classifier.parameters()):
            param.requires_grad_(False)
        self.sep_token_id = self._sep_token_id(config)
        self.activation = _ACTIVATIONS[self._activation_name(config)]

    @staticmethod
    def _sep_token_id(config: Any) -> int:
        sep = getattr(config, "sep_token_id", None)
        if sep is None:
            from transformers import AutoTokenizer

            sep = AutoTokenizer.from_pretrained(config._name_or_path).sep_token_id
        if sep is None:
            raise ValueError(
                "BertForSequenceClassification: neither config.json nor the tokenizer names a [SEP] token"
            )
        return int(sep)

    @staticmethod
    def _activation_name(config: Any) -> str:
        st = getattr(config, "sentence_transformers", None) or {}
        name = st.get("activation_fn") or getattr(config, "sbert_ce_default_activation_function", None)
        name = name or "torch.nn.modules.linear.Identity"
        if name not in _ACTIVATIONS:
            raise ValueError(
                f"config.json: the cross-encoder activation {name!r} is not implemented by srt "
                f"(one of: {', '.join(_ACTIVATIONS)})"
            )
        return name

    def rename_checkpoint_tensor(self, name: str) -> str:
        return name.removeprefix("bert.").replace("pooler.dense.", "pooler.")

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return name.removeprefix("bert.") == "embeddings.position_ids"

    def token_types(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """1 for every token after a request's first [SEP], else 0 (BERT's pair encoding)."""
        types = []
        start = 0
        for length in lengths:
            sep = (input_ids[start : start + length] == self.sep_token_id).to(torch.int64)
            types.append(((sep.cumsum(0) - sep) > 0).to(torch.int64))
            start += length
        return torch.cat(types)

    def pool(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """hidden [tokens, hidden] -> float32 scores [requests, num_labels]."""
        starts = torch.tensor([0, *lengths[:-1]], device=hidden.device).cumsum(0)
        cls = hidden[starts].float()
        return self.activation(self.classifier(torch.tanh(self.pooler(cls))))
