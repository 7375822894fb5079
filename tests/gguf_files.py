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


def k_quant_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's 12 bytes of a super-block's eight 6-bit scales `sc` and mins `mn` (uint8
    [supers, 8] each): the low six bits of the first four of each, then the last four's low nibbles,
    their top two bits in the first eight bytes' top bits."""
    return torch.cat(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4,
        ],
        dim=1,
    )


def q5_k_blocks(n: int, k: int, g: torch.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """Random GGUF Q5_K super-blocks of an [n, k] weight (k % 256 == 0) in the file's 176-byte layout:
    fp16 d and dmin, 12 bytes of 6-bit scales and mins (Q4_K's packing), qh[32] (bit s of byte l:
    the fifth bit of sub-block s's value l), qs[128] (sub-blocks 2i and 2i + 1 in the low and high
    nibbles of bytes 32i .. 32i + 31). Returns (the blocks as uint8 [n, k / 256 * 176], q [n, k] in
    0..31). Each sub-block holds a q of 0 and one of 31, its values within about +-0.2."""
    supers = n * k // 256
    scales_and_mins = torch.randint(32, 64, (supers, 2, 8), generator=g, dtype=torch.uint8)
    scales = k_quant_scales(scales_and_mins[:, 0], scales_and_mins[:, 1])
    q = torch.randint(0, 32, (supers, 8, 32), generator=g, dtype=torch.uint8)
    q[:, :, 5], q[:, :, 20] = 0, 31
    qs = ((q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4).reshape(supers, 128)
    qh = ((q >> 4) << torch.arange(8, dtype=torch.uint8)[:, None]).sum(1, dtype=torch.uint8)
    d = torch.rand(supers, 1, generator=g) * 1e-4 + 1.5e-4
    dmin = d * (torch.rand(supers, 1, generator=g) + 15)  # dmin mn about d sc 15.5: values around 0
    raw = torch.cat([torch.cat([d, dmin], 1).half().view(torch.uint8), scales, qh, qs], dim=1)
    return raw.view(n, k // 256 * 176).numpy(), q.view(n, k)


def write_llama_q5_k_gguf(out: Path, seed: int = 0, v_q8_0: bool = False) -> Path:
    """A tiny random Llama of SmolLM2's vocabulary (hidden 256, so that every projection's input is
    a multiple of Q5_K's 256) as llama.cpp's `llama` architecture: every projection Q5_K blocks
    (q5_k_blocks), the token embedding and output fp16 (of bf16 values), the norms float32. With
    `v_q8_0`, each attn_v is Q8_0 (gguf-py's quantizer) beside the Q5_K q and k, as llama.cpp's
    Q4_K_M and Q5_K_M keep v in more bits than the rest in half their layers."""
    hidden, intermediate, layers, heads, kv_heads, vocab = 256, 512, 2, 4, 2, 49152
    g = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-llama-q5_k")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q5_K_M)
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    copy_tokenizer(writer, vocab)

    def dense(name: str, shape: tuple[int, ...], std: float) -> None:
        """fp16 values that bf16 holds exactly: srt's bf16 copy is the file's weight"""
        values = (torch.randn(shape, generator=g) * std).bfloat16().float()
        writer.add_tensor(name, values.numpy().astype(np.float16))

    dense("token_embd.weight", (vocab, hidden), 1.0)
    head_dim = hidden // heads
    for i in range(layers):
        for name, (n, k) in {
            "attn_q": (hidden, hidden),
            "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden),
            "attn_output": (hidden, hidden),
            "ffn_gate": (intermediate, hidden),
            "ffn_up": (intermediate, hidden),
            "ffn_down": (hidden, intermediate),
        }.items():
            if name == "attn_v" and v_q8_0:
                values = (torch.randn(n, k, generator=g) * 0.03).numpy()
                blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                continue
            blocks = q5_k_blocks(n, k, g)[0]
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q5_K)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    head = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16().float()
    head[::192] *= (
        10  # 256 tokens far likelier than the rest: greedy picks with clear margins, as a trained model's
    )
    writer.add_tensor("output.weight", head.numpy().astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
