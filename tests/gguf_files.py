"""GGUF files written from tiny random checkpoints with gguf-py, laid out as llama.cpp's
convert_hf_to_gguf.py lays out the architecture (tensor names, stacked experts, metadata keys), with
the bundled SmolLM2 GGUF's tokenizer: what a user's converted checkpoint looks like, made here."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from srt.default_model import default_model_path

ATTENTION = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}


def copy_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The bundled SmolLM2 GGUF's tokenizer fields, for a model of its vocabulary."""
    reader = gguf.GGUFReader(default_model_path())
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == vocab_size


SHARED_EXPERT = {
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def write_qwen_moe_gguf(model_dir: Path, out: Path) -> Path:
    """A Qwen3-MoE or Qwen2-MoE checkpoint of SmolLM2's vocabulary (tiny_models' *_smollm2_vocab) as a
    float32 GGUF of llama.cpp's `qwen3moe` or `qwen2moe` architecture."""
    config = json.loads((model_dir / "config.json").read_text())
    qwen3 = config["model_type"] == "qwen3_moe"
    assert not config.get("mlp_only_layers") and config.get("decoder_sparse_step", 1) == 1
    # llama.cpp's qwen3moe graph always renormalizes the top-k weights, its qwen2moe graph never does
    assert bool(config.get("norm_topk_prob")) == qwen3
    state = load_file(str(model_dir / "model.safetensors"))
    num_experts = int(config.get("num_experts") or config["num_local_experts"])
    writer = gguf.GGUFWriter(str(out), "qwen3moe" if qwen3 else "qwen2moe")
    writer.add_name("tiny-" + config["model_type"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if qwen3:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    else:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    copy_tokenizer(writer, config["vocab_size"])

    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(tensor.to(torch.float32).numpy()))

    add("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for hf, ours in {**ATTENTION, **SHARED_EXPERT}.items():
            for kind in ("weight", "bias"):
                if f"{prefix}{hf}.{kind}" in state:
                    add(f"blk.{i}.{ours}.{kind}", state[f"{prefix}{hf}.{kind}"])
        if f"{prefix}mlp.shared_expert_gate.weight" in state:  # [1, hidden] in HF, a vector in GGUF
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", state[f"{prefix}mlp.shared_expert_gate.weight"][0])
        for proj, ours in (
            ("gate_proj", "ffn_gate_exps"),
            ("up_proj", "ffn_up_exps"),
            ("down_proj", "ffn_down_exps"),
        ):
            experts = [state[f"{prefix}mlp.experts.{e}.{proj}.weight"] for e in range(num_experts)]
            add(f"blk.{i}.{ours}.weight", torch.stack(experts))
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
