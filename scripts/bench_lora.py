"""LoRA adapters against the base model alone: decode output tok/s of one batch, side by side.

    python scripts/bench_lora.py [--batch-size 8] [--adapters 4] [--rank 16] [--targets all]
        [--max-new-tokens 64] [--rounds 2] [--llama [--llama-server CMD]]

Three srt servers on the bundled SmolLM2-135M-Instruct (bf16, or --model-path an HF folder), one
at a time: "base" without LoRA, "lora base rows" with --enable-lora and `--adapters` adapters loaded
but every row on the base model, and "lora mixed" with the batch's rows spread over the adapters
(row i on adapter i % adapters). The adapters are peft folders written here with random A and B
(rank `--rank`, on q/k/v/o and the MLP's projections with `--targets all`, on q and v with
`--targets qv`). Each run sends one `/generate` batch of `--batch-size` prompts (16 random token
ids each), greedy with ignore_eos, and counts output tokens over its wall time; each round runs the
configurations in turn, every other round in reverse (the machine is shared and noisy). The table
gives each one's median and its ratio to "base" (issue 61 asks the mixed batch to cost at most
1.25x).

`--llama` adds llama.cpp's server (llama_peer.py; one slot per row) on the bundled GGUF (or
`--llama-gguf`) with the same adapters converted by llama.cpp's convert_lora_to_gguf.py
(`--llama-convert`, default beside the llama-server binary's source tree), each request scaling its
own adapter to 1 and the others to 0 in `lora`; it runs base rows and mixed rows the same way.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import torch  # noqa: E402
from bench_clients import http_call  # noqa: E402
from llama_peer import LlamaServer, llama_command  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from srt.default_model import default_model_path  # noqa: E402
from srt.server_process import ServerProcess  # noqa: E402

TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Llama-style projection."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(model_dir: Path, path: Path, targets: list[str], rank: int, seed: int) -> Path:
    """A peft folder of random A and B (B nonzero, so the adapter changes the tokens)."""
    config = json.loads((model_dir / "config.json").read_text())
    shapes = module_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            where = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


def prompts(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 20000, (16,), generator=g).tolist() for _ in range(batch)]


def srt_run(url: str, batch: list[list[int]], adapters: list[str | None], new: int) -> tuple[float, int]:
    body = {
        "input_ids": batch,
        "lora_path": adapters,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    start = time.perf_counter()
    answer = http_call(f"{url}/generate", timeout_s=600, json_body=body)
    seconds = time.perf_counter() - start
    if answer.status != 200:
        raise RuntimeError(f"/generate: HTTP {answer.status}: {answer.text[:300]}")
    return seconds, sum(len(o["output_ids"]) for o in answer.json())


def llama_run(
    url: str, batch: list[list[int]], adapters: list[int | None], count: int, new: int
) -> tuple[float, int]:
    def one(i: int) -> int:
        lora = [{"id": a, "scale": 1.0 if adapters[i] == a else 0.0} for a in range(count)]
        body = {"prompt": batch[i], "n_predict": new, "temperature": 0.0, "ignore_eos": True, "lora": lora}
        answer = http_call(f"{url}/completion", timeout_s=600, json_body=body)
        if answer.status != 200:
            raise RuntimeError(f"llama.cpp /completion: HTTP {answer.status}: {answer.text[:300]}")
        return int(answer.json()["tokens_predicted"])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        tokens = sum(pool.map(one, range(len(batch))))
    return time.perf_counter() - start, tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="an HF folder (default: the bundled SmolLM2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-args", default="", help="more launch_server flags for every srt server")
    parser.add_argument("--llama", action="store_true", help="add llama.cpp's server with the same adapters")
    parser.add_argument("--llama-server", default=None, help="llama.cpp server command (default: on PATH)")
    parser.add_argument("--llama-convert", default=None, help="llama.cpp's convert_lora_to_gguf.py")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument(
        "--llama-gguf", default=None, help="llama.cpp's base model (default: the bundled GGUF)"
    )
    return parser.parse_args()


def convert_for_llama(
    args: argparse.Namespace, model_dir: Path, folders: list[Path], work: Path
) -> list[Path]:
    """Each adapter as a LoRA GGUF, by llama.cpp's own convert_lora_to_gguf.py."""
    command = llama_command(args.llama_server)
    tree = Path(command[0]).resolve().parents[2]  # build/bin/llama-server -> the source tree
    convert = Path(args.llama_convert) if args.llama_convert else tree / "convert_lora_to_gguf.py"
    ggufs = []
    for folder in folders:
        out = work / f"{folder.name}.gguf"
        cmd = [sys.executable, str(convert), str(folder), "--base", str(model_dir), "--outtype", "f32"]
        subprocess.run(
            [*cmd, "--outfile", str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        ggufs.append(out)
    return ggufs


def main() -> None:
    args = parse_args()
    from model_executor.loader.model_path import resolve_model_path

    model_dir = resolve_model_path(args.model_path)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"a{i}" for i in range(args.adapters)]
    folders = [
        write_adapter(model_dir, work / n, TARGETS[args.targets], args.rank, seed=i)
        for i, n in enumerate(names)
    ]
    batch = prompts(args.batch_size, seed=0)
    mixed = [names[i % args.adapters] for i in range(args.batch_size)]
    base_flags = ["--model-path", str(model_dir), *shlex.split(args.server_args)]
    lora_flags = [*base_flags, "--lora-paths", *(f"{n}={f}" for n, f in zip(names, folders, strict=True))]
    lora_flags += ["--max-loras-per-batch", str(args.adapters), "--max-lora-rank", str(args.rank)]
    configs: list[tuple[str, list[str], list[str | None]]] = [
        ("base", base_flags, [None] * args.batch_size),
        ("lora base rows", lora_flags, [None] * args.batch_size),
        ("lora mixed", lora_flags, list(mixed)),
    ]
    llama = convert_for_llama(args, model_dir, folders, work) if args.llama else None
    llama_gguf = args.llama_gguf or default_model_path()
    rates: dict[str, list[float]] = {}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for name, flags, adapters in order:
            with ServerProcess(flags) as server:
                srt_run(server.url, batch[:1], adapters[:1], 4)  # warm up
                seconds, tokens = srt_run(server.url, batch, adapters, args.max_new_tokens)
            rates.setdefault(name, []).append(tokens / seconds)
            print(f"round {r + 1} {name}: {tokens / seconds:.1f} tok/s", flush=True)
        if llama is not None:
            extra = [flag for g in llama for flag in ("--lora", str(g))]
            with LlamaServer(
                llama_command(args.llama_server),
                llama_gguf,
                args.llama_threads,
                parallel=args.batch_size,
                extra=extra,
            ) as peer:
                ids = [i % args.adapters for i in range(args.batch_size)]
                for name, rows in (
                    ("llama.cpp base rows", [None] * args.batch_size),
                    ("llama.cpp mixed", ids),
                ):
                    llama_run(peer.url, batch[:1], rows[:1], args.adapters, 4)
                    seconds, tokens = llama_run(peer.url, batch, rows, args.adapters, args.max_new_tokens)
                    rates.setdefault(name, []).append(tokens / seconds)
                    print(f"round {r + 1} {name}: {tokens / seconds:.1f} tok/s", flush=True)
    print(
        f"\nbatch {args.batch_size}, {args.adapters} adapters of rank {args.rank} on {args.targets}, "
        f"{args.max_new_tokens} new tokens, medians of {args.rounds} rounds"
    )
    print("| configuration | output tok/s | time / base's |")
    print("|---|---|---|")
    base = statistics.median(rates["base"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.1f} | {base / rate:.2f}x |")


if __name__ == "__main__":
    main()
