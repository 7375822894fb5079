"""LoRA through the linear-method seam: a layer's product plus, for each adapter's rows of the step,
scaling * (x A^T) B^T.

With LoRA on, every adaptable linear layer gets a LoraLinearMethod around the method it had (the
CPU's packed one, or F.linear): the base product runs over every row exactly as without LoRA, so a
base row gets the same bits in any batch; then each adapter's rows (grouped: one pair of matmuls
per adapter present, as punica and S-LoRA group them on GPUs) add their delta, in float32, rounded
once into the layer's output. With deterministic inference each row's delta runs on its own (a
row's bits then never depend on its batch, as a restart's replay needs).

Tensor parallelism shards an adapter as its layer: a column-parallel layer keeps B's rows of this
rank's outputs (A whole); a row-parallel one keeps A's columns of this rank's inputs (B whole) and
adds its partial delta to the partial product before the layer's all-reduce, which sums the deltas
exactly as it sums the products: no collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_executor.layers.linear_method import LinearLayer, LinearMethod


@dataclass(frozen=True)
class LoraPart:
    """One adapted module of a (merged) layer: its ranks' rows of the layer's stacked A and the
    output columns its B writes (this rank's)."""

    ranks: slice  # rows of LayerLora.a
    outputs: slice  # columns of the layer's output on this rank
    b: torch.Tensor  # [outputs, ranks] float32, lora_B scaled by the adapter's scaling


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
            target[:, part.outputs] += xa[:, part.ranks] @ part.b.T
        if rows is not None:
            out.index_copy_(0, rows, target)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * 4 + sum(p.b.numel() * 4 for p in self.parts)


@dataclass
class LoraBatch:
    """The step's rows of each adapter, set by LoraAdapters.begin before each forward and read by
    every layer's LoraLinearMethod: (adapter id, token rows or None for all), in ascending id."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    # deterministic inference: each row's delta on its own (one-row matmuls), so its bits never
    # depend on the rows beside it, as a restart's replay needs
    row_by_row: bool = False


class LoraLinearMethod(LinearMethod):
    """The linear method of an adaptable layer with LoRA on: `base`'s product, plus the delta of
    each adapter of the step that adapts this layer. No one-pass silu_mul (`apply_silu_mul` is
    None): every batch, with adapters or not, takes the product then the activation."""

    def __init__(self, base: LinearMethod, batch: LoraBatch) -> None:
        self.base = base
        self.batch = batch
        self.adapters: dict[int, LayerLora] = {}  # adapter id -> its weights on this layer

    def apply(
        self,
        layer: LinearLayer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        out = self.base.apply(layer, x, bias, out_dtype)
        out_rows, x_rows = out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
        for adapter, rows in self.batch.groups:
            lora = self.adapters.get(adapter)
            if lora is None:
                continue
            if not self.batch.row_by_row:
                lora.add_to(out_rows, x_rows, rows)
                continue
            for row in range(x_rows.shape[0]) if rows is None else rows.tolist():
                lora.add_to(out_rows, x_rows, torch.tensor([row], device=x.device))
        return out

    @property
    def packed_weight(self) -> object | None:
        return self.base.packed_weight
