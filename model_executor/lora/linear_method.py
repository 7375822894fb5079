"""LoRA through the linear-method seam: a layer's product plus, for each adapter's rows of the step,
scaling * (x A^T) B^T.

With LoRA on, every adaptable linear layer gets a LoraLinearMethod around the method it had (the
CPU's packed one, or F.linear): the base product runs over every row exactly as without LoRA, so a
base row gets the same bits in any batch; then the device's lora_delta op (layers/fused_ops.py) adds
each adapter row's delta, in float32, rounded once into the layer's output. On the CPU that is one
kernel call per layer for every adapter of the step (cpu_lora.c), each row on its own, so a row's
bits never depend on its batch; elsewhere one pair of matmuls per adapter present (grouped as
punica and S-LoRA group them on GPUs), or, with deterministic inference, per row.

An adapter attaches to a slot (LoraAdapters keeps them few and reuses them); each layer keeps its
adapters by slot and, for the kernel, a table of their addresses (srt_lora_delta's).

Tensor parallelism shards an adapter as its layer: a column-parallel layer keeps B's rows of this
rank's outputs (A whole); a row-parallel one keeps A's columns of this rank's inputs (B whole) and
adds its partial delta to the partial product before the layer's all-reduce, which sums the deltas
exactly as it sums the products: no collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_executor.layers.fused_ops import fused_ops
from model_executor.layers.linear_method import LinearLayer, LinearMethod


@dataclass(frozen=True)
class LoraPart:
    """One adapted module of a (merged) layer: its ranks' rows of the layer's stacked A and the
    output columns its B writes (this rank's)."""

    ranks: slice  # rows of LayerLora.a
    outputs: slice  # columns of the layer's output on this rank
    bt: torch.Tensor  # [ranks, outputs] float32: lora_B scaled by the adapter's scaling, transposed


@dataclass(frozen=True)
class LayerLora:
    """One adapter on one linear layer, this rank's shard: the A of every adapted module stacked
    (q, k, v in the order of the layer's outputs), and each module's B."""

    a: torch.Tensor  # [sum of ranks, this rank's input features] float32
    parts: tuple[LoraPart, ...]

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Adds the delta of x's `rows` (None: every row) into `out`'s, in float32 rounded once."""
        xs = x if rows is None else x.index_select(0, rows)
        xa = xs.float() @ self.a.T
        target = out if rows is None else out.index_select(0, rows)
        for part in self.parts:
            target[:, part.outputs] += xa[:, part.ranks] @ part.bt
        if rows is not None:
            out.index_copy_(0, rows, target)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * 4 + sum(p.bt.numel() * 4 for p in self.parts)


@dataclass
class LoraBatch:
    """The step's rows of each adapter, set by LoraAdapters.begin before each forward (`start`) and
    read by every layer's LoraLinearMethod: each token row's slot (int32, -1 for the base model;
    None when no row has an adapter)."""

    row_slots: torch.Tensor | None = None
    # deterministic inference: the torch products of each row on its own (one-row matmuls), so its
    # bits never depend on the rows beside it, as a restart's replay needs (the kernel's always are)
    row_by_row: bool = False
    _groups: list[tuple[int, torch.Tensor | None]] | None = field(default=None, repr=False)

    def start(self, row_slots: torch.Tensor | None) -> None:
        """A new step's rows."""
        self.row_slots, self._groups = row_slots, None

    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, its token rows or None for all) in ascending slot, for the torch products: made
        from row_slots at the step's first call (the kernel reads row_slots alone)."""
        if self._groups is None:
            rows = self.row_slots
            groups: list[tuple[int, torch.Tensor | None]] = []
            if rows is not None:
                slots = [s for s in torch.unique(rows).tolist() if s != -1]
                if len(slots) == 1 and bool((rows == slots[0]).all()):
                    groups = [(slots[0], None)]  # every row: no gather
                else:
                    groups = [(s, (rows == s).nonzero().squeeze(1)) for s in slots]
            self._groups = groups
        return self._groups


class LoraLinearMethod(LinearMethod):
    """The linear method of an adaptable layer with LoRA on: `base`'s product, plus the delta of
    each adapter of the step that adapts this layer. No one-pass silu_mul (`apply_silu_mul` is
    None): every batch, with adapters or not, takes the product then the activation."""

    def __init__(self, base: LinearMethod, batch: LoraBatch) -> None:
        self.base = base
        self.batch = batch
        self.adapters: dict[int, LayerLora] = {}  # slot -> this adapter's weights on this layer
        self.table: torch.Tensor | None = None  # srt_lora_delta's, by slot (None: no kernel)
        self.ops = fused_ops()

    def attach(self, slot: int, lora: LayerLora | None) -> None:
        """Puts `lora` in `slot` (None: empties it) and rewrites the kernel's table."""
        if lora is None:
            self.adapters.pop(slot, None)
        else:
            self.adapters[slot] = lora
        self.table = self.ops.lora_table(self.adapters)

    @property
    def row_slots(self) -> torch.Tensor:
        assert self.batch.row_slots is not None
        return self.batch.row_slots

    def apply(
        self,
        layer: LinearLayer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        out = self.base.apply(layer, x, bias, out_dtype)
        if self.batch.row_slots is not None and self.adapters:
            self.ops.lora_delta(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), self)
        return out

    def add_each(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """The torch products: one pair of matmuls per adapter of the step (or per row)."""
        for slot, rows in self.batch.groups():
            lora = self.adapters.get(slot)
            if lora is None:
                continue
            if not self.batch.row_by_row:
                lora.add_to(out, x, rows)
                continue
            for row in range(x.shape[0]) if rows is None else rows.tolist():
                lora.add_to(out, x, torch.tensor([row], device=x.device))

    @property
    def packed_weight(self) -> object | None:
        return self.base.packed_weight
