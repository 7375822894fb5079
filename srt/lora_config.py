"""LoRA adapters as `--lora-paths` names them and as peft saves them (adapter_config.json beside
adapter_model.safetensors), read with json alone: what every process may check before a rank reads
a tensor. What srt does not implement is refused here by the field's name; what needs the base
model (a target it lacks, shapes) is checked where the adapter attaches (model_executor/lora/).

An adapter's id is its place in `--lora-paths` counted from 1 (0 is the base model): every rank
derives the same ids from the same flags; adapters loaded at runtime take the next ids
(scheduler/lora_registry.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE_ID = 0  # the base model's adapter id: no adapter

# peft's fields that change the math, and the value srt implements: any other is refused by name
_FIXED: tuple[tuple[str, Any, str], ...] = (
    ("use_dora", False, "DoRA's magnitude vectors"),
    ("modules_to_save", None, "modules trained in full"),
    ("bias", "none", "trained biases"),
    ("lora_bias", False, "a bias on lora_B"),
    ("fan_in_fan_out", False, "transposed (Conv1D) weights"),
    ("rank_pattern", {}, "per-module ranks"),
    ("alpha_pattern", {}, "per-module alphas"),
    ("layer_replication", None, "replicated layers"),
    ("target_parameters", None, "parameters targeted directly (MoE experts)"),
    ("trainable_token_indices", None, "trained token embeddings"),
    ("use_qalora", False, "QA-LoRA's pooled input"),
    ("alora_invocation_tokens", None, "activated LoRA"),
)


@dataclass(frozen=True)
class LoraRef:
    """One `--lora-paths` entry: the adapter's name (what requests give as lora_path or model) and
    its folder."""

    name: str
    path: str


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json srt reads: the rank, the scaling of the product, the
    targets as peft lists them (a list of module names, or one regular expression)."""

    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...] | str


def parse_lora_paths(entries: tuple[str, ...] | None) -> tuple[LoraRef, ...]:
    """`name=path` entries, or bare paths named by their folder (as SGLang takes them); ValueError
    naming --lora-paths for a duplicate name or an empty part."""
    refs: list[LoraRef] = []
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = Path(entry.rstrip("/")).name, entry
        if not name or not path:
            raise ValueError(f"--lora-paths takes name=path or a path; got {entry!r}")
        if any(ref.name == name for ref in refs):
            raise ValueError(f"--lora-paths names the adapter {name!r} twice")
        refs.append(LoraRef(name, path))
    return tuple(refs)


def read_adapter_config(path: str | Path, max_rank: int | None = None) -> AdapterConfig:
    """The adapter_config.json of the peft folder `path`, checked: ValueError naming the field (and
    the adapter's folder) for anything srt does not implement or a rank above `max_rank`."""
    folder = Path(path)
    where = f"LoRA adapter {str(folder)!r}"
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE} (a peft adapter folder has one)")
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{where}: no {WEIGHTS_FILE} (srt reads an adapter's weights from safetensors)")
    raw = json.loads((folder / CONFIG_FILE).read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r} is not implemented; srt has LORA")
    for name, off, what in _FIXED:
        value = raw.get(name)
        if value is not None and value != off and (off == "none" or value):  # null and empties: off
            raise ValueError(f"{where}: {name} = {value!r} ({what}) is not implemented in srt")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"{where}: r = {rank} exceeds --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if not targets or not isinstance(targets, (str, list)):
        raise ValueError(
            f"{where}: target_modules must name the modules the adapter changes, got {targets!r}"
        )
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return AdapterConfig(rank, float(scaling), targets if isinstance(targets, str) else tuple(targets))


def check_adapter(
    ref: LoraRef, max_rank: int | None, allowed_targets: tuple[str, ...] | None
) -> AdapterConfig:
    """`ref`'s config, read and checked as at start-up (read_adapter_config), and its targets within
    `--lora-target-modules` where that is given: what the front end checks before any rank reads a
    tensor, at start-up and at a runtime load. ValueError naming the cause."""
    config = read_adapter_config(ref.path, max_rank)
    allowed = set(allowed_targets or ())
    targets = config.target_modules
    if allowed and "all" not in allowed and isinstance(targets, tuple) and set(targets) - allowed:
        raise ValueError(
            f"LoRA adapter {ref.name!r}: target_modules {sorted(set(targets) - allowed)} are not in "
            f"--lora-target-modules {sorted(allowed)}"
        )
    return config
