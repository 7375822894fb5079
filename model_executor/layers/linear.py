"""Tensor-parallel linear layers (Megatron style).

Column-parallel splits the output features across TP ranks (no communication); row-parallel splits
the input features and all-reduces the partial sums inside `forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.layers.fused_ops import fused_ops
from model_executor.layers.linear_method import UNQUANTIZED, LinearMethod
from model_executor.layers.sharding import TensorSource, check_shape, divide, set_weight_attrs


class LinearBase(nn.Module):
    """A layer that multiplies by its `weight` through its linear method: UNQUANTIZED until a
    device's wing sets another after loading (layers/linear_method.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_method: LinearMethod = UNQUANTIZED

    @property
    def packed_weight(self) -> object | None:
        """The copy of the weight the linear method's kernels read (None: the weight as loaded)."""
        return self.linear_method.packed_weight


class ColumnParallelLinear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        comm: Communicator,
        *,
        params_dtype: torch.dtype = torch.float32,
        what: str = "output features",
    ) -> None:
        super().__init__()
        self.comm = comm
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, comm.world_size, what)
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_rank, input_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_rank, dtype=params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        size = param.shape[0]
        shard = loaded.narrow(0, self.comm.rank_in_group * size, size)
        check_shape(param, tuple(shard.shape))
        with torch.no_grad():
            param.copy_(shard)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's columns of x @ weight.T + bias, in x's dtype or `out_dtype` (float32: the
        sums before any bf16 rounding, where the kernel writes them)."""
        return self.linear_method.apply(self, x, self.bias, out_dtype)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed into one matmul (gate/up): shard i of each rank holds
    this rank's slice of output i, laid end to end."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        comm: Communicator,
        *,
        params_dtype: torch.dtype = torch.float32,
        what: str = "intermediate size",
    ) -> None:
        self.output_sizes = output_sizes
        for size in output_sizes:
            divide(size, comm.world_size, what)
        super().__init__(input_size, sum(output_sizes), bias, comm, params_dtype=params_dtype, what=what)
        for p in self.parameters():
            set_weight_attrs(p, self.weight_loader, shard_ids=tuple(range(len(output_sizes))))
        self.ops = fused_ops()  # the activation of silu_mul

    def weight_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        assert isinstance(shard_id, int), shard_id
        tp = self.comm.world_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        shard = loaded.narrow(0, self.comm.rank_in_group * size, size)
        dst = param.narrow(0, offset, size)
        check_shape(dst, tuple(shard.shape))
        with torch.no_grad():
            dst.copy_(shard)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gate/up layer's product: in one pass where the linear method has one
        (the CPU kernels' packed weights), else the product then the activation."""
        act = self.linear_method.apply_silu_mul(self, x, self.bias)
        return act if act is not None else self.ops.silu_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections in one matmul. Query heads split across ranks; KV heads split when there
    are at least as many as ranks, otherwise replicated (each rank keeps the one KV head its query
    heads attend to)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        comm: Communicator,
        *,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        tp = comm.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "number of key/value heads")
            self.kv_replicas = 1
        else:
            divide(tp, num_kv_heads, "tensor-parallel size vs key/value heads")
            self.num_kv_heads = 1
            self.kv_replicas = tp // num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            (self.q_size + 2 * self.kv_size) * tp,
            bias,
            comm,
            params_dtype=params_dtype,
            what="q/k/v output features",
        )
        for p in self.parameters():
            set_weight_attrs(p, self.weight_loader, shard_ids=("q", "k", "v"))

    def weight_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        rank = self.comm.rank_in_group
        if shard_id == "q":
            offset, size, index = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, index = self.kv_size, rank // self.kv_replicas
        else:
            raise AssertionError(shard_id)
        shard = loaded.narrow(0, index * size, size)
        dst = param.narrow(0, offset, size)
        check_shape(dst, tuple(shard.shape))
        with torch.no_grad():
            dst.copy_(shard)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(LinearBase):
    """Splits the input features; all-reduces partial outputs. Only rank 0 adds the bias, so the
    sum carries it once. The output is float32: in the models every row-parallel product (o_proj,
    down_proj) is added to the float32 residual stream, so a kernel that keeps its float32 sums
    (the CPU's packed bf16 one) hands them on unrounded and the partial sums add in float32."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        comm: Communicator,
        *,
        params_dtype: torch.dtype = torch.float32,
        what: str = "input features",
    ) -> None:
        super().__init__()
        self.comm = comm
        self.input_size_per_rank = divide(input_size, comm.world_size, what)
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_rank, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, self._bias_loader)

    def weight_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        size = param.shape[1]
        shard = loaded.narrow(1, self.comm.rank_in_group * size, size)
        check_shape(param, tuple(shard.shape))
        with torch.no_grad():
            param.copy_(shard)

    def _bias_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        shard = loaded.narrow(0, 0, param.shape[0])
        check_shape(param, tuple(shard.shape))
        with torch.no_grad():
            param.copy_(shard)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's float32 part of the product (the bias on rank 0 only), not yet all-reduced."""
        bias = self.bias if self.comm.rank_in_group == 0 else None
        return self.linear_method.apply(self, x, bias, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.partial(x))
