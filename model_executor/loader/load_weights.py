"""Copies checkpoint tensors into a model's (possibly sharded, possibly packed) parameters.

Every parameter must be loaded (every shard of a packed one) and every checkpoint tensor used,
unless the model says to skip it; otherwise a ValueError lists the names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn
from tqdm import tqdm

from model_executor.layers.sharding import default_weight_loader

logger = logging.getLogger("srt.loader")


class NamedTensorSource(Protocol):
    name: str

    @property
    def shape(self) -> Any: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def _target(model: nn.Module, name: str) -> tuple[str, Any]:
    """The parameter a (renamed) checkpoint tensor's name loads into, and the shard id."""
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    for ckpt_part, (param_part, shard_id) in mapping.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


class RowSlice:
    """Rows start .. start + rows of a checkpoint tensor, under another name: one part of a tensor
    the checkpoint stores fused (Phi-3's qkv_proj and gate_up_proj), read lazily like the whole."""

    def __init__(self, name: str, source: NamedTensorSource, start: int, rows: int) -> None:
        self.name, self.source, self.start, self.rows = name, source, start, rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *tuple(self.source.shape)[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.source.narrow(0, self.start + start, length)
        return self.source.narrow(0, self.start, self.rows).narrow(dim, start, length)


class PermutedRows:
    """A checkpoint tensor with its rows reordered: row j is the source's row order[j] (q and k rows
    in srt's rotary layout, layers/rotary.py rope_permutation). `order` keeps whole blocks in place
    (a head's rows stay the head's), so a narrow along rows reads only the span it needs."""

    def __init__(self, source: NamedTensorSource, order: torch.Tensor) -> None:
        self.name, self.source, self.order = source.name, source, order

    @property
    def shape(self) -> Any:
        return self.source.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = self.order[start : start + length] if dim == 0 else self.order
        first = int(rows.min())
        span = self.source.narrow(0, first, int(rows.max()) - first + 1)
        picked = span.index_select(0, rows - first)
        return picked if dim == 0 else picked.narrow(dim, start, length)


def param_parts(model: nn.Module, tensor: NamedTensorSource) -> list[tuple[NamedTensorSource, str, Any]]:
    """Each part of a checkpoint tensor (split where the checkpoint fuses what the model keeps apart,
    or rows reordered) with the parameter name and shard id it loads into, as load_weights maps
    them; no part for a tensor the model skips (another pipeline stage's, a rotary cache). The
    LoRA loader maps an adapter's B through it, so B's rows land as the weight's do."""
    skip = getattr(model, "skip_checkpoint_tensor", lambda name: False)
    rename = getattr(model, "rename_checkpoint_tensor", lambda name: name)
    split = getattr(model, "split_checkpoint_tensor", lambda tensor: [tensor])
    return [(part, *_target(model, rename(part.name))) for part in split(tensor) if not skip(part.name)]


class LoadHooks:
    """What a device wing does while the checkpoint loads; each default does nothing."""

    def source(self, tensor: NamedTensorSource) -> NamedTensorSource:
        """What to read for a checkpoint tensor (the CPU wing: a GGUF file's blocks in place of
        their dequantized values, for a weight that runs on them)."""
        return tensor

    def sink(self, param_name: str) -> Any | None:
        """What the parameter's weight loader copies each shard into in place of the parameter (it
        takes `narrow(0, start, length)` and `copy_`), or None: the parameter."""
        return None

    def loaded(self, param_name: str) -> None:
        """Every shard of the parameter is in (its sink's or the parameter)."""


def load_weights(
    model: nn.Module,
    checkpoint: Iterable[NamedTensorSource],
    *,
    progress: bool = False,
    hooks: LoadHooks | None = None,
) -> None:
    """Loads every checkpoint tensor into its parameter, or the sink `hooks` gives for it; tells
    `hooks` when each parameter is in."""
    params = dict(model.named_parameters())
    shards = {name: set(getattr(param, "shard_ids", ()) or (None,)) for name, param in params.items()}
    loaded: dict[str, set[Any]] = {}
    unused: list[str] = []
    items = tqdm(checkpoint, desc="Loading weights", unit="tensor", disable=not progress)
    source = hooks.source if hooks is not None else (lambda tensor: tensor)
    for tensor, target, shard_id in (part for whole in items for part in param_parts(model, source(whole))):
        param = params.get(target)
        if param is None:
            unused.append(tensor.name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        sink = hooks.sink(target) if hooks is not None else None
        into = param if sink is None else sink
        try:
            if shard_id is None:
                loader(into, tensor)
            else:
                loader(into, tensor, shard_id)
        except ValueError as e:
            raise ValueError(
                f"shape mismatch: checkpoint tensor {tensor.name!r} of shape {tuple(tensor.shape)} "
                f"does not fit parameter {target!r} of shape {tuple(param.shape)} on this rank: {e}"
            ) from e
        loaded.setdefault(target, set()).add(shard_id)
        if hooks is not None and loaded[target] == shards[target]:
            del param, into, sink
            hooks.loaded(target)
            # the hook may have replaced the parameter (the CPU wing frees a weight it packed): hold
            # the one the model has now, so the bytes of the old one go at once
            params[target] = model.get_parameter(target)

    missing = []
    for name, expected in shards.items():
        got = loaded.get(name, set())
        if got != expected:
            missing.append(
                name if expected == {None} else f"{name} (shards {sorted(map(str, expected - got))})"
            )
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} model parameter(s) not found in the checkpoint: {', '.join(missing[:20])}"
        )
    if unused:
        problems.append(f"{len(unused)} checkpoint tensor(s) not used by the model: {', '.join(unused[:20])}")
    if problems:
        raise ValueError("; ".join(problems))
    logger.debug("loaded %d parameters", len(params))
