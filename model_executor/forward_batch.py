"""What one forward pass runs: the tensors every layer reads, built once per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_executor.attention.base import AttentionBackend


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: new tokens of each request, after an optional cached prefix
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """One step's inputs, flattened over requests.

    Token order is request-major: request 0's new tokens, then request 1's, and so on.

        extend:  |-- prefix (cached) --|-- new (extend_seq_lens) --|
                 0              prefix_len                     seq_len
        decode:  prefix_len == seq_len - 1, one new token.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64: rows of ReqToTokenPool.req_to_token
    seq_lens: torch.Tensor  # [bs] int64: prefix + new tokens, after this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slots the new tokens are written to
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # cached tokens before the new ones (decode: seq_len - 1)
    extend_seq_lens_cpu: list[int]  # new tokens per request (decode: all 1)
    attn_backend: AttentionBackend | None = None  # set by the ModelRunner before the forward
    # the window slots of out_cache_loc, where local layers keep window pages (mem_cache/window_pages.py);
    # set by the ModelRunner before the forward
    window_cache_loc: torch.Tensor | None = None
    # each request's prompt length (LongRoPE's rule, layers/rotary.py); None: each request's tokens
    # through this step, as one forward of transformers sees them
    prompt_lens_cpu: list[int] | None = None
    rope_rows: bool = False  # positions were mapped to rotary table rows (LongRoPE's long ones)
    # each request's LoRA adapter id (0: the base model; model_executor/lora/); None: no adapter
    lora_ids: list[int] | None = None

    def __post_init__(self) -> None:
        bs = len(self.seq_lens_cpu)
        assert len(self.extend_prefix_lens_cpu) == bs and len(self.extend_seq_lens_cpu) == bs
        assert sum(self.extend_seq_lens_cpu) == self.input_ids.numel() == self.out_cache_loc.numel()
        for prefix, new, total in zip(
            self.extend_prefix_lens_cpu, self.extend_seq_lens_cpu, self.seq_lens_cpu
        ):
            assert 0 <= prefix and new >= 1 and prefix + new == total, (prefix, new, total)
        assert self.lora_ids is None or len(self.lora_ids) == bs

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


def make_forward_batch(
    mode: ForwardMode,
    input_ids: list[int],
    req_pool_indices: list[int],
    prefix_lens: list[int],
    seq_lens: list[int],
    out_cache_loc: torch.Tensor,
    device: torch.device | str = "cpu",
    prompt_lens: list[int] | None = None,
    lora_ids: list[int] | None = None,
) -> ForwardBatch:
    """Builds the step's tensors from per-request Python lists (prefix_lens[i] < seq_lens[i]);
    prompt_lens: each request's prompt length, where the model's rotary needs it (LongRoPE);
    lora_ids: each request's adapter, where one has one."""
    new_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
    if mode is ForwardMode.DECODE:
        positions = [s - 1 for s in seq_lens]
    else:
        positions = [pos for p, s in zip(prefix_lens, seq_lens) for pos in range(p, s)]
    return ForwardBatch(
        mode=mode,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        out_cache_loc=out_cache_loc,
        seq_lens_cpu=list(seq_lens),
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=new_lens,
        prompt_lens_cpu=None if prompt_lens is None else list(prompt_lens),
        lora_ids=lora_ids if lora_ids is not None and any(lora_ids) else None,
    )
