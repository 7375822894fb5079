"""A sparse mixture-of-experts MLP: a router picks each token's top-k experts, each expert is the
Llama MLP (down(silu(gate) * up)), and the token's output is the routing-weighted sum of its experts'
outputs (plus a gated shared expert: Qwen2-MoE).

Tensor parallelism shards every expert as the dense MLP is sharded (gate/up by columns, down by
rows), so each rank holds a slice of every expert; the router and the routing run on the replicated
hidden state, and the experts' partial sums are added locally and all-reduced once, in float32, as
the dense MLP's down product is. Every rank therefore picks the same experts for every token from
the same bits, and nothing crosses replicas.

Routing is a function of the token's own row: the router's logits (float32), a softmax, the top k
with ties to the lowest expert id, and each expert's output added to the token's sum in ascending
expert id. A token's output depends on no other token in its step, so batch invariance,
deterministic inference and exact replay hold for MoE models as for dense ones, wherever the
experts' linears compute a row whatever rows share their call (the CPU kernels in one-arithmetic
mode).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from model_executor.distributed.communicator import Communicator
from model_executor.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from model_executor.layers.sharding import TensorSource, check_shape, read_all, set_weight_attrs


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole (the router, the shared expert's gate): its product is
    float32, the kernels' sums unrounded where its weight is packed for them. The weight is padded
    with zero rows to a multiple of 32 outputs, so that the CPU kernels take it whatever the number
    of experts (8, 60, 1): a row's logits are then the same bits in any batch (deterministic
    inference), which F.linear does not promise. Never quantized (as SGLang and vLLM keep the
    router)."""

    quantizable = False
    ROWS = 32  # the packed bf16 kernel's multiple of output features (cpu/kernels/packing.py)

    def __init__(self, input_size: int, output_size: int, *, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.output_size = output_size
        padded = -(-output_size // self.ROWS) * self.ROWS
        self.weight = nn.Parameter(torch.zeros(padded, input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: TensorSource, shard_id: object = None) -> None:
        check_shape(param[: self.output_size], tuple(loaded.shape))
        with torch.no_grad():
            param[: self.output_size].copy_(read_all(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, None, torch.float32)[:, : self.output_size]


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [n, experts] -> (weights float32 [n, top_k], expert ids int64 [n, top_k]): the
    softmax's k largest probabilities, equal ones in ascending expert id (a stable sort, where
    torch.topk leaves the order of ties unspecified), divided by their sum where `renormalize`
    (Mixtral always; Qwen-MoE and OLMoE where norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    """One expert on this rank: its gate/up columns and down rows (the checkpoint's gate_proj,
    up_proj and down_proj, or Mixtral's w1, w3 and w2, load into them)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, comm: Communicator, dtype: torch.dtype, what: str
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, comm, params_dtype=dtype, what=what
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, False, comm, params_dtype=dtype, what=what
        )

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's float32 part of the expert's output for rows x (summed over ranks: the
        output), not yet all-reduced."""
        return self.down_proj.partial(self.gate_up_proj.silu_mul(x))


class ExpertsMethod(ABC):
    """How a SparseMoeBlock runs where a device's wing gives it one (the CPU's: routing, every active
    expert and the shared expert in one kernel call, cpu/moe.py); without one, torch ops and a loop
    over the experts' linear methods. Set after the weights are packed."""

    @abstractmethod
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out float32 [n, hidden], expert ids [n, top_k]) for rows x: what the block computes
        before its all-reduce (this rank's part), routed as select_experts routes, each token's
        experts added in ascending id; adds each expert's tokens to the block's expert_tokens."""


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one decoder layer: `gate` (the router, [experts, hidden]), `experts`, and where
    `shared_intermediate_size` is set Qwen2-MoE's `shared_expert` with its `shared_expert_gate`
    (sigmoid of a [1, hidden] product). forward(x) -> float32 [n, hidden], all-reduced."""

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        comm: Communicator,
        dtype: torch.dtype,
        layer_id: int,
        shared_intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        # called with (layer_id, expert ids [n, top_k]) each forward: return_routed_experts
        self.route_hook: Callable[[int, torch.Tensor], None] | None = None
        # tokens routed to each expert since start (/metrics' routing skew)
        self.expert_tokens = torch.zeros(num_experts, dtype=torch.int64)
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
            )
        self.comm = comm
        self.top_k = top_k
        self.renormalize = renormalize
        self.num_experts = num_experts
        self.gate = ReplicatedLinear(hidden_size, num_experts, params_dtype=dtype)
        what = "the experts' intermediate size (moe_intermediate_size)"
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size, comm, dtype, what) for _ in range(num_experts)
        )
        self.experts_method: ExpertsMethod | None = None  # set by a device's wing (cpu/moe.py)
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_intermediate_size:
            self.shared_expert = Expert(
                hidden_size, shared_intermediate_size, comm, dtype, "shared_expert_intermediate_size"
            )
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, params_dtype=dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [n, top_k], expert ids [n, top_k]) of rows x: the same on every rank."""
        return select_experts(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.experts_method is not None and n:
            out, ids = self.experts_method.forward(x)
            if self.route_hook is not None:
                self.route_hook(self.layer_id, ids)
            return self.comm.all_reduce(out)
        out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
        if n:
            weights, ids = self.route(x)
            if self.route_hook is not None:
                self.route_hook(self.layer_id, ids)
            # each expert's (token, slot) pairs, expert after expert, tokens ascending
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts)
            self.expert_tokens += counts
            self._experts_loop(x, counts.tolist(), order // self.top_k, weights.flatten()[order], out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out += gate * self.shared_expert.partial(x)
        return self.comm.all_reduce(out)

    def _experts_loop(
        self, x: torch.Tensor, counts: list[int], rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Adds to out [n, hidden] each active expert's output for its rows of x times their routing
        weights, expert by expert in ascending id through their linear methods: counts [experts]
        tokens each; rows and weights list them expert after expert (tokens ascending)."""
        start = 0
        for expert_id, count in enumerate(counts):  # ascending id: a token's sum in a fixed order
            if not count:
                continue
            expert = self.experts[expert_id]
            assert isinstance(expert, Expert)
            expert_rows = rows[start : start + count]
            partial = expert.partial(x if count == x.shape[0] == 1 else x[expert_rows])
            out.index_add_(0, expert_rows, partial * weights[start : start + count, None])
            start += count
