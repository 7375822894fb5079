"""How a checkpoint tensor is narrowed to this rank's shard.

A parameter carries `weight_loader(param, loaded, shard_id)`; `loaded` is anything with `.shape`
and `.narrow(dim, start, length)` (a `LazyTensor` reads only those bytes from disk, a torch.Tensor
works too). `shard_ids` lists the shards a packed parameter expects, so the loader can tell when
one is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class TensorSource(Protocol):
    @property
    def shape(self) -> Any: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


WeightLoader = Callable[..., None]


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, or a ValueError naming both sizes (e.g. heads vs --tp-size)."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
            f"choose a --tp-size that divides {numerator}"
        )
    return numerator // denominator


def read_all(loaded: TensorSource) -> torch.Tensor:
    shape = tuple(loaded.shape)
    return loaded.narrow(0, 0, shape[0]) if shape else loaded.narrow(0, 0, 1)


def check_shape(param: torch.Tensor, got: tuple[int, ...], name: str = "") -> None:
    if tuple(param.shape) != tuple(got):
        raise ValueError(
            f"shape mismatch for {name or 'parameter'}: model expects {tuple(param.shape)}, "
            f"checkpoint shard has {tuple(got)}"
        )


def set_weight_attrs(
    param: torch.nn.Parameter, weight_loader: WeightLoader, shard_ids: tuple[Any, ...] = ()
) -> None:
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]


def default_weight_loader(param: torch.Tensor, loaded: TensorSource, shard_id: Any = None) -> None:
    """A replicated parameter: the whole checkpoint tensor."""
    assert shard_id is None, shard_id
    check_shape(param, tuple(loaded.shape))
    with torch.no_grad():
        param.copy_(read_all(loaded) if tuple(loaded.shape) else torch.as_tensor(loaded))
