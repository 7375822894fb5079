"""A mixture-of-experts layer's experts on the CPU kernels: every active expert of a step in one C
call (srt_moe_experts_bf16, cpu_moe.c), where each expert's gate/up and down weights are packed for
srt_bf16_linear. Python's share of a step no longer grows with the experts it runs: measured on a
mid-size Qwen3-MoE (docs/performance.md)."""

from __future__ import annotations

import torch
from torch import nn

from model_executor.cpu.kernels import build
from model_executor.cpu.linear import is_kernel_packed, packed_of
from model_executor.layers.moe import Expert, ExpertsMethod, SparseMoeBlock


class FusedExperts(ExpertsMethod):
    def __init__(self, block: SparseMoeBlock, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
        self.packed = (gate_up, down)  # keeps the tensors behind the addresses alive
        self.gate_up = torch.tensor([t.data_ptr() for t in gate_up], dtype=torch.int64)
        self.down = torch.tensor([t.data_ptr() for t in down], dtype=torch.int64)
        self.num_experts = block.num_experts
        self.d = gate_up[0].shape[0] * 8  # [2d/16, k/32, 16, 16, 2]

    @classmethod
    def of(cls, block: SparseMoeBlock) -> FusedExperts | None:
        """The block's fused experts where every expert's weights are packed bf16 for our kernels
        (not int8 or Q4: those stay on the torch loop), else None."""
        if build.kernels() is None or not build.bf16_linear_available():
            return None
        gate_up: list[torch.Tensor] = []
        down: list[torch.Tensor] = []
        for expert in block.experts:
            assert isinstance(expert, Expert)
            for linear, into in ((expert.gate_up_proj, gate_up), (expert.down_proj, down)):
                packed = packed_of(linear.linear_method)
                if not isinstance(packed, torch.Tensor) or not is_kernel_packed(packed):
                    return None  # is_kernel_packed: bf16_pack's layout, so both sizes divide by 32
                into.append(packed)
        return cls(block, gate_up, down)

    def apply(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        rows: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        lib = build.kernels()
        assert lib is not None
        x = x.contiguous()
        m, k = x.shape
        counts, rows = counts.contiguous(), rows.contiguous()
        weights = weights.contiguous()
        xg = torch.empty(m, k, dtype=torch.bfloat16)
        act = torch.empty(m, self.d, dtype=torch.bfloat16)
        y = torch.empty(m, k, dtype=torch.float32)
        lib.srt_moe_experts_bf16(
            x.data_ptr(),
            m,
            k,
            self.d,
            self.num_experts,
            self.gate_up.data_ptr(),
            self.down.data_ptr(),
            counts.data_ptr(),
            rows.data_ptr(),
            weights.data_ptr(),
            xg.data_ptr(),
            act.data_ptr(),
            y.data_ptr(),
            out.data_ptr(),
        )


def fuse_experts(model: nn.Module) -> int:
    """Gives every SparseMoeBlock whose experts are packed bf16 its FusedExperts; returns how many.
    Call after pack_model."""
    fused = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.experts_method = FusedExperts.of(module)
            fused += module.experts_method is not None
    return fused
