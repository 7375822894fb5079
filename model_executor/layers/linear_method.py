"""LinearMethod: how a linear layer multiplies by its weight.

A layer holds one and calls `apply`; it knows nothing of how its weight is laid out. Every layer
starts on UNQUANTIZED (F.linear on the weight as loaded); after loading, a device's wing may give a
layer a method over a copy of the weight laid out for its kernels (the CPU's PackedLinearMethod in
model_executor/cpu/linear.py: bf16, int8 or Q4_1), as vLLM's and SGLang's quantization methods do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.nn.functional as F


class LinearLayer(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...


class LinearMethod(ABC):
    @abstractmethod
    def apply(
        self,
        layer: LinearLayer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x @ layer.weight.T (+ bias), in x's dtype, or in `out_dtype` where given (float32 logits).
        Mutates nothing."""

    def apply_silu_mul(
        self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up of a gate/up layer's product in one pass, the [rows, 2d] product never
        stored, equal to the activation of `apply`'s result; None where this method has no such pass
        for x (the caller then runs `apply` and the activation)."""
        return None

    @property
    def packed_weight(self) -> object | None:
        """The copy of the weight this method's kernels read; None where it reads the weight as
        loaded."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """F.linear on the weight as loaded."""

    def apply(
        self,
        layer: LinearLayer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        out = F.linear(x, layer.weight, bias)
        return out if out_dtype is None else out.to(out_dtype)


UNQUANTIZED = UnquantizedLinearMethod()  # holds nothing of a layer's: one for every layer
