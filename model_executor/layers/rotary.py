"""Rotary position embedding (neox / rotate-half layout, as transformers' Llama), with Llama 3
frequency scaling, linear scaling and LongRoPE's short and long factors. cos/sin are precomputed for
every position once (LongRoPE: for each set of factors).

Partial rotary (partial_rotary_factor < 1: Phi-4-mini, GLM-4) and interleaved pairs (GLM-4's
(0,1),(2,3),... rather than rotate-half's (i, i + d/2)) run on the same whole-head rotate-half
tables and kernels: `rope_permutation` reorders each head's q and k rows at load (the model does it,
models/llama.py), so that the pairs transformers rotates sit at (j, j + d/2) for j < rotary_dim / 2
and the dims it passes through at the rest, whose table frequencies are 0 (cos 1, sin 0: x * 1 + y *
0 is x exactly). q and k are permuted alike, so q . k, hence attention, is transformers'; v is not.
No C path steps aside: srt_rope and the fused decode layer read the same whole-head tables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_executor.layers.fused_ops import fused_ops

ROPE_TYPES = ("default", "linear", "llama3", "longrope")  # the rope_type values _inv_freq computes


def rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings from a transformers config, old style (rope_theta + rope_scaling) or new
    (rope_parameters)."""
    params: dict[str, Any] = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "partial_rotary_factor", None) is not None:  # a config of transformers 4's layout
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


@dataclass(frozen=True)
class LongRope:
    """Where LongRoPE's long factors apply. transformers picks the factors per forward: the long ones
    for every position of a forward whose last position is past original_max_position_embeddings (a
    prompt longer than that: all of it; a decode step past it: that token; the cached keys keep what
    they were computed with), else the short ones. Per token that is: long where the request's prompt
    is longer than `original` or the position is at least `original`, a function of the request and
    the position, never of the batch or the chunk, so chunked prefill, batching, retraction and
    replay rotate a token alike. The rotary tables hold the short rows, then the long ones from row
    `offset`: `rows` maps positions to table rows."""

    original: int
    offset: int

    def rows(self, positions: torch.Tensor, prompt_lens: list[int], new_lens: list[int]) -> torch.Tensor:
        """Table rows of a step's positions; prompt_lens[i] and new_lens[i]: request i's prompt
        length and its tokens in this step (positions is request-major)."""
        prompt = torch.tensor(prompt_lens, dtype=torch.int64).repeat_interleave(torch.tensor(new_lens))
        long = (prompt.to(positions.device) > self.original) | (positions >= self.original)
        return positions + self.offset * long


def long_rope(params: dict[str, Any], max_position: int) -> LongRope | None:
    """The LongRope of a checkpoint with LongRoPE's short and long factors and a context past its
    original_max_position_embeddings; None for another rope (or no long factors)."""
    if params.get("rope_type") != "longrope" or params.get("long_factor") is None:
        return None
    original = int(params["original_max_position_embeddings"])
    return LongRope(original, max_position) if original < max_position else None


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """The dims of each head that rotate: int(head_dim * partial_rotary_factor), as transformers."""
    factor = params.get("partial_rotary_factor")
    return head_dim if factor is None else int(head_dim * float(factor))


def rope_permutation(head_dim: int, rotary: int, interleaved: bool) -> torch.Tensor | None:
    """Row order of one head of q or k in srt's layout, as indices into transformers' rows (srt row j
    is transformers' row perm[j]); None: the layouts agree (the whole head, rotate-half).
    transformers rotates its first `rotary` dims in pairs (i, i + rotary/2) (`interleaved`: (2i,
    2i + 1)) and passes the rest through; srt rotates (j, j + head_dim/2), pair i of transformers
    at j = i, its pass-through dims split between [rotary/2, head_dim/2) and the second half's tail."""
    if rotary == head_dim and not interleaved:
        return None
    if rotary % 2 or (head_dim - rotary) % 2:
        raise ValueError(f"rotary dims {rotary} of a head of {head_dim}: both halves must be whole")
    half, rest = rotary // 2, (head_dim - rotary) // 2
    i = torch.arange(half)
    first, second = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
    passed = torch.arange(rotary, head_dim)
    return torch.cat([first, passed[:rest], second, passed[rest:]])


def attention_scaling(params: dict[str, Any], max_position: int) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor (given, or from the context
    extension factor as transformers computes it), else 1."""
    if params.get("rope_type") != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = float(params["original_max_position_embeddings"])
    factor = float(params["factor"]) if params.get("factor") is not None else max_position / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _inv_freq(head_dim: int, params: dict[str, Any], long: bool = False) -> torch.Tensor:
    """Inverse frequencies of head_dim / 2 pairs: those of the rotary dims' pairs (over rotary_dim, as
    transformers computes them), then 0 for the pass-through dims' (cos 1, sin 0); `long`:
    LongRoPE's long factors, not its short ones."""
    rotary = rotary_dim(head_dim, params)
    inv_freq = _rotary_inv_freq(rotary, params, long)
    return torch.cat([inv_freq, torch.zeros((head_dim - rotary) // 2)])


def _rotary_inv_freq(dim: int, params: dict[str, Any], long: bool) -> torch.Tensor:
    base = float(params["rope_theta"])
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = params.get("rope_type", "default")
    if rope_type == "longrope":
        factors = params["long_factor"] if long else params["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**shape)
    inv_freq = 1.0 / (base**shape)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """One module serves every layer; cos/sin rows are gathered once per forward (per positions
    tensor), not once per layer. A partial rotary's tables are whole-head ones whose pass-through
    pairs have frequency 0, for q and k in `rope_permutation`'s layout.

    rotate(x) = x * [cos, cos] + roll(x, d/2) * [-sin, sin], which is transformers'
    x * cos + rotate_half(x) * sin in the same float operations, in four kernels.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, _inv_freq(head_dim, params))
        if long_rope(params, max_position) is not None:  # the long factors' rows after the short ones
            freqs = torch.cat([freqs, torch.outer(t, _inv_freq(head_dim, params, long=True))])
        cos, sin = freqs.cos(), freqs.sin()
        scaling = attention_scaling(params, max_position)
        if scaling != 1.0:  # LongRoPE: transformers scales cos and sin in float32, before the cast
            cos, sin = cos * scaling, sin * scaling
        # float32 tables, cast once to the model dtype: transformers does the same per step.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1).to(dtype), persistent=False)
        self._cached_positions: torch.Tensor | None = None
        self._cached_cos_sin: tuple[torch.Tensor, torch.Tensor] = (self.cos, self.sin)
        self.ops = fused_ops()

    def forget_positions(self) -> None:
        """A forward begins: the next rotate gathers its rows again, even for the same positions
        tensor. A tensor refilled in place (a CUDA graph's static positions) is the same object with
        other values; and inside a graph capture the gather must run to be recorded."""
        self._cached_positions = None
        self._cached_cos_sin = (self.cos, self.sin)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, [n, 1, head_dim]: gathered once per positions tensor."""
        if positions is not self._cached_positions:
            self._cached_positions = positions
            self._cached_cos_sin = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self._cached_cos_sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] -> a rotated copy (contiguous)."""
        return self.ops.rope(self, positions, x)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, hq*d], k [n, hk*d] -> rotated copies of the same shapes."""
        n = positions.shape[0]
        return (
            self.rotate(positions, q.reshape(n, -1, self.head_dim)).view(n, -1),
            self.rotate(positions, k.reshape(n, -1, self.head_dim)).view(n, -1),
        )
