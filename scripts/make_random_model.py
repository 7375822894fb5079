"""A random-weight checkpoint shaped like the bundled SmolLM2-135M, with a head layout you choose.

    python scripts/make_random_model.py OUT_DIR [--num-heads 6] [--num-kv-heads 2] [--seed 0] [--moe]
    python scripts/make_random_model.py OUT_DIR --llama3-8b [--num-layers 32] [--device cuda]

SmolLM2-135M has 9 attention heads and 3 KV heads, so it cannot run at --tp-size 2. This writes a
LlamaForCausalLM with its configuration (hidden 576, 30 layers, intermediate 1536, vocab 49152,
tied embeddings) except the heads (default 6 heads of 96 and 2 KV heads: TP=2 divides both), random
bf16 weights, and SmolLM2's tokenizer, for benchmarks that need an even head count at the same size
and cost per step (e.g. `bench_control_plane.py --tp-size 2 --model-path OUT_DIR`). Its outputs are
meaningless text; nothing is downloaded. With --moe: a mid-size random Qwen3-MoE instead
(make_random_moe_model), for the mixture-of-experts benchmarks. With --llama3-8b: Llama-3-8B's
shape (make_llama3_8b_shape: 16 GB of bf16 weights at 32 layers) with a made-up word-level tokenizer
of its vocabulary size, built on --device, for the GPU checks (scripts/device_check.sh), where no
tokenizer file travels.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_random(model_cls: Any, config: Any, out: Path, smollm2: Path, seed: int) -> Path:
    """Random bf16 weights for `config` written to `out` with SmolLM2's tokenizer files; returns `out`."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, out / name)
    return out


def make_random_model(
    out: Path, num_heads: int = 6, num_kv_heads: int = 2, seed: int = 0, num_layers: int | None = None
) -> Path:
    """Writes the checkpoint and SmolLM2's tokenizer to `out`; returns `out`."""
    import transformers

    from model_executor.loader.model_path import resolve_model_path
    from model_executor.loader.weight_source import load_hf_config

    smollm2 = resolve_model_path(None)
    base = load_hf_config(smollm2)
    if base.hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden size {base.hidden_size} must divide by --num-heads {num_heads}, and "
            f"--num-heads by --num-kv-heads {num_kv_heads}"
        )
    config = transformers.LlamaConfig(
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=num_layers or base.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=base.hidden_size // num_heads,
        vocab_size=base.vocab_size,
        max_position_embeddings=base.max_position_embeddings,
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
    )
    return save_random(transformers.LlamaForCausalLM, config, out, smollm2, seed)


def make_random_moe_model(
    out: Path,
    *,
    num_experts: int = 32,
    top_k: int = 4,
    hidden_size: int = 1024,
    moe_intermediate_size: int = 512,
    num_layers: int = 8,
    num_heads: int = 16,
    num_kv_heads: int = 4,
    seed: int = 0,
) -> Path:
    """A random bf16 Qwen3-MoE (head_dim 64) with SmolLM2's vocabulary and tokenizer: the mid-size
    mixture of experts of issue 37's benchmark by default (32 experts, top 4, hidden 1024, 8 layers)."""
    import transformers

    from model_executor.loader.model_path import resolve_model_path
    from model_executor.loader.weight_source import load_hf_config

    smollm2 = resolve_model_path(None)
    base = load_hf_config(smollm2)
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden_size,
        intermediate_size=4 * moe_intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        vocab_size=base.vocab_size,
        max_position_embeddings=base.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
    )
    return save_random(transformers.Qwen3MoeForCausalLM, config, out, smollm2, seed)


LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def word_level_tokenizer(vocab_size: int) -> Any:
    """A tokenizer with `vocab_size` made-up words ("<unk>", "<s>", "</s>", then "w3", "w4", ...),
    split on whitespace and joined with spaces: every id decodes, and a text of such words encodes
    back to its ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def make_llama3_8b_shape(out: Path, num_layers: int = 32, device: str = "cpu", seed: int = 0) -> Path:
    """Llama-3-8B's configuration (LLAMA3_8B) with `num_layers` layers, random bf16 weights
    initialised on `device` (transformers' init: std 0.02), and word_level_tokenizer of its vocabulary.
    Returns `out`."""
    import transformers

    config = transformers.LlamaConfig(
        **{**LLAMA3_8B, "num_hidden_layers": num_layers}, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    word_level_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--num-heads", type=int, default=6, help="default: %(default)s")
    parser.add_argument("--num-kv-heads", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a Qwen3-MoE instead: 32 experts, top 4, hidden 1024, 8 layers, 16 heads of 64, 4 KV heads "
        "(--num-heads / --num-kv-heads ignored)",
    )
    parser.add_argument(
        "--llama3-8b",
        action="store_true",
        help="Llama-3-8B's shape with a made-up tokenizer instead (--num-heads / --num-kv-heads ignored)",
    )
    parser.add_argument("--num-layers", type=int, default=32, help="with --llama3-8b; default: %(default)s")
    parser.add_argument("--device", default="cpu", help="with --llama3-8b: where the weights are made")
    args = parser.parse_args(argv)
    try:
        if args.llama3_8b:
            path = make_llama3_8b_shape(args.out, args.num_layers, args.device, args.seed)
        elif args.moe:
            path = make_random_moe_model(args.out, seed=args.seed)
        else:
            path = make_random_model(args.out, args.num_heads, args.num_kv_heads, args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
