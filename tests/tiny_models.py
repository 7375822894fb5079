"""Tiny random-weight checkpoints made with transformers (nothing is downloaded)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_mqa": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    # Gemma 3: a local layer (window 16, its own rope base) then a global one, q/k norms, post-norms
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        },
    ),
    # Gemma 2: soft-capped scores and logits (caps low enough to bend them), window 16 in layer 0
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    # q/k/v and gate/up stored fused, every layer within a window of 16
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"sliding_window": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # LongRoPE: short and long factors, a 128-token original context of 512
    "phi3_longrope": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "original_max_position_embeddings": 128,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
    # Phi-4-mini's partial rotary: the first 12 of each head's 16 dims rotate (rotate-half), 4 pass
    "phi3_partial": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"partial_rotary_factor": 0.75, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # GLM-4: sandwich norms, q/k/v biases, fused gate/up, the first half of each head rotating in
    # interleaved pairs (partial_rotary_factor 0.5)
    "glm4": (
        transformers.Glm4Config,
        transformers.Glm4ForCausalLM,
        {"head_dim": 16, "partial_rotary_factor": 0.5, "pad_token_id": 0, "eos_token_id": 2},
    ),
    # norms after attention and the MLP, q and k normed across their heads
    "olmo2": (
        transformers.Olmo2Config,
        transformers.Olmo2ForCausalLM,
        {"pad_token_id": 0, "eos_token_id": 2},
    ),
    # every layer attending within its last 16 tokens
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 16}),
    # head size 64, 3 query heads per kv head (as SmolLM2): the shapes the AMX attention kernels take
    "llama_d64": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1},
    ),
    # 64 KiB of fp32 KV a token (16 kv heads of 256, 2 layers) on little compute: host memory tests
    "llama_wide_kv": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256},
    ),
    # SmolLM2's vocabulary and a long context: any text its tokenizer makes, chat templates included
    "llama_smollm2_vocab": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"vocab_size": 49152, "max_position_embeddings": 8192},
    ),
    # Qwen-shaped (qkv biases) with SmolLM2's vocabulary: tool calls through a Qwen chat template
    "qwen2_smollm2_vocab": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"vocab_size": 49152, "max_position_embeddings": 4096},
    ),
    # Mixtures of experts (model_executor/models/moe.py); every expert's linears packable (multiples of 32)
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        # 32 experts (the router packable too), layer 1 dense
        {
            "head_dim": 32,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
    # one KV head: at TP=2 both ranks hold it, and k's norm across heads counts it once
    "olmoe": (
        transformers.OlmoeConfig,
        transformers.OlmoeForCausalLM,
        {
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "intermediate_size": 64,
            "num_key_value_heads": 1,
            "pad_token_id": 0,
            "eos_token_id": 2,
        },
    ),
    # a MoE model on the default path's shapes: SmolLM2's vocabulary, heads of 64 (the attention
    # kernels'), text prompts through SmolLM2's tokenizer
    # Qwen2-MoE with its shared expert and qkv biases, SmolLM2's vocabulary (as a GGUF with its tokenizer)
    "qwen2_moe_smollm2_vocab": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 4096,
        },
    ),
    "qwen3_moe_smollm2_vocab": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_experts": 24,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "vocab_size": 49152,
            "max_position_embeddings": 4096,
        },
    ),
}

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def make_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Larger-than-init weights make the logits spread out, so greedy ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                # A MoE router 10x wider: its choices clear, so that a near-tie flipped by rounding
                # (chance, on either side of a comparison) seldom decides a test of precision.
                p.normal_(0.0, 1.0 if name.endswith(".gate.weight") else 0.1)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)  # Gemma's norms scale by 1 + w: w starts at 0, which hides a missing 1
            elif arch == "olmo2" and name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)  # its post-norms and q/k norms: not all ones, which hides a missing norm
            elif arch == "glm4" and name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)  # its sandwich norms: not all ones, which hides a missing norm
            elif arch == "glm4" and name.endswith(".bias"):
                p.normal_(0.0, 0.3)  # q/k/v biases start at 0, which hides a bias left unpermuted
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Reference greedy continuation with transformers' own KV cache (no EOS stop)."""
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        result = model(ids, use_cache=True)
        for _ in range(steps):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


def hf_float32(model_dir: Path) -> Any:
    """transformers' model in float32, as a reference, with its weights copied into process memory:
    from_pretrained leaves float32 weights mapped from the safetensors file, and this VM's DAMON
    pages out file pages that sit idle for a minute, so a reference's forward could wait on disk."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


def hf_forced_logits(model: Any, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """transformers' logits at each position of the `forced` tokens after each prompt (teacher
    forcing), [steps, bs, vocab]: the reference for test_cpu_kernels.decode_logits."""
    with torch.no_grad():
        return torch.stack(
            [model(torch.tensor([p + f])).logits[0, len(p) :] for p, f in zip(prompts, forced)], dim=1
        )
