"""A mixture-of-experts layer on the CPU kernels: the router, the routing, every active expert and
the shared expert of a step in one C call (srt_moe_block, cpu_moe.c), where each of their weights is
packed for srt_bf16_linear. Python's share of a step no longer grows with the experts it runs, and
the fused decoder layer (srt_decode_layer) makes the same call, so prefill and decode route alike:
measured on a mid-size Qwen3-MoE (docs/performance.md)."""

from __future__ import annotations

import torch
from torch import nn

from model_executor.cpu.kernels import build
from model_executor.cpu.linear import is_kernel_packed, packed_of
from model_executor.layers.linear import LinearBase
from model_executor.layers.moe import Expert, ExpertsMethod, SparseMoeBlock


def _packed_bf16(linear: LinearBase) -> torch.Tensor | None:
    packed = packed_of(linear.linear_method)
    # is_kernel_packed on a tensor: bf16_pack's layout, so both sizes divide by 32
    return packed if isinstance(packed, torch.Tensor) and is_kernel_packed(packed) else None


class FusedExperts(ExpertsMethod):
    def __init__(self, block: SparseMoeBlock, weights: list[torch.Tensor]) -> None:
        """`weights`: the router's packed weight, each expert's gate_up and down, and with a shared
        expert its gate_up, down and gate."""
        self.block = block
        self.weights = weights  # keeps the tensors behind the addresses alive
        router, experts = weights[0], weights[1 : 1 + 2 * block.num_experts]
        self.gate_up = torch.tensor([t.data_ptr() for t in experts[0::2]], dtype=torch.int64)
        self.down = torch.tensor([t.data_ptr() for t in experts[1::2]], dtype=torch.int64)
        shared = weights[1 + 2 * block.num_experts :]
        self.descriptor = torch.tensor(  # srt_moe_block's `moe`
            [
                block.num_experts,
                block.top_k,
                int(block.renormalize),
                experts[0].shape[0] * 8,  # [2d/16, k/32, 16, 16, 2]
                self.gate_up.data_ptr(),
                self.down.data_ptr(),
                router.data_ptr(),
                router.shape[0] * 16,
                block.expert_tokens.data_ptr(),
                shared[0].shape[0] * 8 if shared else 0,
                *(t.data_ptr() for t in shared),
                *([0] * (3 - len(shared))),
            ],
            dtype=torch.int64,
        )

    @classmethod
    def of(cls, block: SparseMoeBlock) -> FusedExperts | None:
        """The block's fused form where the router and every expert's weights are packed bf16 for our
        kernels (not int8 or Q4: those stay on the torch loop), else None."""
        if build.kernels() is None or not build.bf16_linear_available():
            return None
        linears: list[LinearBase] = [block.gate]
        for expert in block.experts:
            assert isinstance(expert, Expert)
            linears += [expert.gate_up_proj, expert.down_proj]
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            linears += [
                block.shared_expert.gate_up_proj,
                block.shared_expert.down_proj,
                block.shared_expert_gate,
            ]
        packed = [_packed_bf16(linear) for linear in linears]
        if not all(isinstance(p, torch.Tensor) for p in packed) or not block.expert_tokens.is_contiguous():
            return None
        return cls(block, [p for p in packed if p is not None])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lib = build.kernels()
        assert lib is not None and x.dtype == torch.bfloat16
        x = x.contiguous()
        m, k = x.shape
        out = torch.empty(m, k, dtype=torch.float32)
        ids = torch.empty(m, self.block.top_k, dtype=torch.int64)
        lib.srt_moe_block(x.data_ptr(), m, k, self.descriptor.data_ptr(), ids.data_ptr(), out.data_ptr())
        return out, ids


def fuse_experts(model: nn.Module) -> int:
    """Gives every SparseMoeBlock whose weights are packed bf16 its FusedExperts; returns how many.
    Call after pack_model."""
    fused = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts_method = FusedExperts.of(module)
            fused += module.experts_method is not None
    return fused
