"""What every node of one server must agree on, and how two nodes' answers differ.

Ranks on different nodes schedule identically only if they were started alike: the same model
weights, parallel sizes, dtype, page size, scheduling limits and code version. Each node publishes
its fingerprint at the rendezvous and compares it with node 0's before any rank starts.
Per-node settings (host, port, node rank, paths, timeouts, log level, memory fraction) stay out.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

# ServerArgs fields that change what a rank computes or which collectives it issues.
SHARED_FIELDS = (
    "tp_size",
    "pp_size",
    "pp_micro_batches",
    "nnodes",
    "dtype",
    "device",
    "quantization",
    "page_size",
    "context_length",
    "max_running_requests",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "schedule_policy",
    "disable_radix_cache",
    "random_seed",
    "attention_backend",
    "grammar_backend",
    "constrained_json_disable_any_whitespace",
    "constrained_json_max_whitespace_cnt",
    "sync_token_ids_across_tp",
    "enable_rank_consensus_checker",
    "speculative_algorithm",  # a verify step's rows are a collective's shape
    "num_draft_tokens",
    "speculative_ngram_max_trie_depth",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
SHOWN_ONLY = "model_path"  # where this node found the model: shown in a message, never compared


def model_digest(model_dir: str | Path) -> str:
    """Same checkpoint, same digest, wherever it lives: config.json's bytes plus every weight
    file's name and size (reading the weights themselves would cost a full pass over them)."""
    root = Path(model_dir)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for path in sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        digest.update(f"{path.name}:{path.stat().st_size};".encode())
    return digest.hexdigest()[:16]


def code_version() -> str:
    import torch

    try:
        srt_version = importlib.metadata.version("srt")
    except importlib.metadata.PackageNotFoundError:
        srt_version = "unknown"
    return f"srt {srt_version}, torch {torch.__version__}"


def launch_fingerprint(server_args: Any, model_dir: str | Path) -> dict[str, str]:
    """Field name -> value as text (JSON-friendly, compared as strings)."""
    fields = {name: str(getattr(server_args, name)) for name in SHARED_FIELDS}
    draft = getattr(server_args, "speculative_draft_model_path", None)  # resolved by the launcher
    if draft is not None:
        fields["draft_model"] = model_digest(draft)
    return {**fields, "model": model_digest(model_dir), "version": code_version(), SHOWN_ONLY: str(model_dir)}


def fingerprint_diff(
    mine: dict[str, str], theirs: dict[str, str], my_node: int, their_node: int
) -> list[str]:
    """One entry per differing field: "dtype (node 0: float32, node 1: bfloat16)"; [] when alike."""
    diffs = []
    for name in sorted(set(mine) | set(theirs)):
        if name == SHOWN_ONLY or mine.get(name) == theirs.get(name):
            continue
        a, b = mine.get(name, "<missing>"), theirs.get(name, "<missing>")
        if name == "model":
            a, b = f"{a} at {mine.get(SHOWN_ONLY)}", f"{b} at {theirs.get(SHOWN_ONLY)}"
        diffs.append(f"{name} (node {my_node}: {a}, node {their_node}: {b})")
    return diffs
