"""One communicator per process group: every collective the model and scheduler issue goes here.

CPU (gloo) and CUDA (NCCL) differ only in which group `device_group` is; `cpu_group` is always gloo
and carries Python objects (the scheduler's broadcasts) and small control tensors.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Communicator:
    """A process group seen from one rank. With `world_size == 1` every collective is the identity
    and no torch.distributed state is needed, so a single-rank engine runs without init."""

    ranks: list[int]  # global ranks in the group, in group order
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    # Deterministic inference: sums in rank order whatever the tensor's size (see all_reduce)
    fixed_order_sum: bool = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @staticmethod
    def single() -> Communicator:
        return Communicator(ranks=[0], rank_in_group=0)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduces in place and returns `tensor`.

        A ring all-reduce adds an element's parts in an order set by where the element falls among
        the ring's chunks, i.e. by the tensor's size: with three or more ranks (two parts add alike
        in either order) a token's sums then depend on how many tokens share the step. With
        `fixed_order_sum` the parts are gathered and added rank 0 first, the same for every size."""
        if self.world_size == 1:
            return tensor
        if self.fixed_order_sum and self.world_size > 2 and op == dist.ReduceOp.SUM:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            return tensor.copy_(total)
        dist.all_reduce(tensor, op=op, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's `tensor` along `dim`, in group order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.ranks[src_in_group], group=self.device_group)
        return tensor

    def send(self, tensor: torch.Tensor, dst_in_group: int) -> None:
        dist.send(tensor.contiguous(), dst=self.ranks[dst_in_group], group=self.device_group)

    def recv(self, tensor: torch.Tensor, src_in_group: int) -> torch.Tensor:
        dist.recv(tensor, src=self.ranks[src_in_group], group=self.device_group)
        return tensor

    def cpu_all_reduce_int(self, value: int, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MIN) -> int:
        """Reduces one integer over the gloo group (used once at start-up, e.g. KV page counts)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.cpu_group)
        return int(t.item())

    def broadcast_pyobj(self, obj: object, src_in_group: int = 0) -> object:
        """Broadcasts a picklable object over the gloo group: a size tensor, then a bytes tensor.

        Every rank must call this the same number of times in the same order; non-source ranks
        pass anything (ignored) and get the source's object back. An empty list (the scheduler's
        "no new messages", most steps) is sent as size 0 alone: one broadcast instead of two.
        """
        if self.world_size == 1:
            return obj
        src = self.ranks[src_in_group]
        if self.rank_in_group == src_in_group:
            payload = encode_object(obj)
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, src=src, group=self.cpu_group)
            if len(payload):
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, src=src, group=self.cpu_group)
            return obj
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            dist.broadcast(data, src=src, group=self.cpu_group)
        return decode_object(data)


def encode_object(obj: object) -> bytes:
    """Pickled, except an empty list: no bytes at all (see decode_object)."""
    return b"" if isinstance(obj, list) and not obj else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode_object(data: torch.Tensor) -> object:
    return pickle.loads(data.numpy().tobytes()) if data.numel() else []
