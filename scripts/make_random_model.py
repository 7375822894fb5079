"""A random-weight checkpoint shaped like the bundled SmolLM2-135M, with a head layout you choose.

    python scripts/make_random_model.py OUT_DIR [--num-heads 6] [--num-kv-heads 2] [--seed 0]

SmolLM2-135M has 9 attention heads and 3 KV heads, so it cannot run at --tp-size 2. This writes a
LlamaForCausalLM with its configuration (hidden 576, 30 layers, intermediate 1536, vocab 49152,
tied embeddings) except the heads (default 6 heads of 96 and 2 KV heads: TP=2 divides both), random
bf16 weights, and SmolLM2's tokenizer, for benchmarks that need an even head count at the same size
and cost per step (e.g. `bench_control_plane.py --tp-size 2 --model-path OUT_DIR`). Its outputs are
meaningless text; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_random_model(
    out: Path, num_heads: int = 6, num_kv_heads: int = 2, seed: int = 0, num_layers: int | None = None
) -> Path:
    """Writes the checkpoint and SmolLM2's tokenizer to `out`; returns `out`."""
    import transformers

    from model_executor.loader.weight_source import load_hf_config, resolve_model_path

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
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--num-heads", type=int, default=6, help="default: %(default)s")
    parser.add_argument("--num-kv-heads", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        path = make_random_model(args.out, args.num_heads, args.num_kv_heads, args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
