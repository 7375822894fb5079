"""Next tokens from one step's logits: greedy, or seeded sampling that every rank repeats exactly.

A sampled token is a pure function of (seed, output_position, filtered probabilities): the noise
comes from a counter-based hash, never from a torch generator, so tensor-parallel ranks agree
without a broadcast and a replayed request draws the same tokens in any batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_executor.layers.fused_ops import fused_ops

_GREEDY_TEMPERATURE = 1e-5  # below this a temperature is treated as 0 (greedy)
_MASK32 = 0xFFFFFFFF
# Salts of four independent hash lanes: (block draw, token draw) x (first, second mixing key).
_SALTS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
# The draw runs over vocab blocks of this size. It is part of the definition of a draw:
# changing it changes which token a (seed, position) picks.
_BLOCK = 256
_FIRST_PREFIX = 64  # top-k/top-p look at this many largest probabilities first, then 8x wider


@dataclass
class SamplingBatchInfo:
    """Per-request sampling settings of one step, one entry per row of the logits."""

    temperatures: torch.Tensor  # [bs] float32; 0 = greedy
    top_ps: torch.Tensor  # [bs] float32 in (0, 1]; 1 = off
    top_ks: torch.Tensor  # [bs] int64; -1 (or >= vocab) = off
    min_ps: torch.Tensor  # [bs] float32 in [0, 1]; 0 = off
    seeds: torch.Tensor  # [bs] int64
    output_positions: torch.Tensor  # [bs] int64; 0 for the first generated token
    is_all_greedy: bool
    has_greedy: bool
    need_top_k_top_p: bool  # some sampled row uses top-k or top-p
    need_min_p: bool  # some sampled row uses min-p

    def __post_init__(self) -> None:
        bs = self.temperatures.shape[0]
        for name, dtype in (
            ("temperatures", torch.float32),
            ("top_ps", torch.float32),
            ("top_ks", torch.int64),
            ("min_ps", torch.float32),
            ("seeds", torch.int64),
            ("output_positions", torch.int64),
        ):
            tensor = getattr(self, name)
            assert tensor.shape == (bs,) and tensor.dtype == dtype, (name, tensor.shape, tensor.dtype)

    @property
    def batch_size(self) -> int:
        return int(self.temperatures.shape[0])

    @classmethod
    def from_lists(
        cls,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        top_ks: Sequence[int],
        min_ps: Sequence[float],
        seeds: Sequence[int],
        output_positions: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingBatchInfo:
        """Validate and pack. top_k == 1 or a temperature below 1e-5 means greedy (exact argmax);
        a seed is taken modulo 2**64."""
        bs = len(temperatures)
        columns = {
            "top_ps": top_ps,
            "top_ks": top_ks,
            "min_ps": min_ps,
            "seeds": seeds,
            "output_positions": output_positions,
        }
        for name, column in columns.items():
            if len(column) != bs:
                raise ValueError(f"{name} has {len(column)} entries, temperatures has {bs}")
        for t, p, k, m, pos in zip(temperatures, top_ps, top_ks, min_ps, output_positions, strict=True):
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
            if not 0 < p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {p!r}")
            if k != -1 and k < 1:
                raise ValueError(f"top_k must be -1 (off) or >= 1, got {k!r}")
            if not 0 <= m <= 1:
                raise ValueError(f"min_p must be in [0, 1], got {m!r}")
            if pos < 0:
                raise ValueError(f"output_position must be >= 0, got {pos!r}")
        greedy = [t < _GREEDY_TEMPERATURE or k == 1 for t, k in zip(temperatures, top_ks, strict=True)]
        sampled = [i for i in range(bs) if not greedy[i]]
        # Seeds wrap into int64 so any Python int is accepted.
        signed_seeds = [((s + 2**63) % 2**64) - 2**63 for s in seeds]
        return cls(
            temperatures=torch.tensor(
                [0.0 if g else t for g, t in zip(greedy, temperatures, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            seeds=torch.tensor(signed_seeds, dtype=torch.int64, device=device),
            output_positions=torch.tensor(output_positions, dtype=torch.int64, device=device),
            is_all_greedy=all(greedy),
            has_greedy=any(greedy),
            need_top_k_top_p=any(top_ps[i] < 1 or top_ks[i] != -1 for i in sampled),
            need_min_p=any(min_ps[i] > 0 for i in sampled),
        )


def apply_penalties(
    logits: torch.Tensor,
    penalties: Sequence[tuple[float, float, float] | None],
    output_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """The logits to sample from, a row per request: with (frequency, presence, repetition) set,
    first the repetition penalty on every token of the prompt and the output (a positive logit
    divided by it, a negative one multiplied, as transformers does), then OpenAI's penalties on the
    tokens generated so far (- frequency x count - presence x [count > 0]), vLLM's order. Rows
    with None, and `logits` itself when every row has None, are left as they are (logprobs read
    the raw logits). A pure function of a request's own tokens, so every rank computes the same."""
    rows = [i for i, p in enumerate(penalties) if p is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    vocab = out.shape[1]
    for i in rows:
        frequency, presence, repetition = penalties[i]  # type: ignore[misc]
        if repetition != 1:
            seen = torch.tensor([*prompt_ids[i], *output_ids[i]], dtype=torch.int64).unique()
            values = out[i, seen]
            out[i, seen] = torch.where(values > 0, values / repetition, values * repetition)
        if (frequency or presence) and output_ids[i]:
            counts = torch.bincount(torch.tensor(output_ids[i], dtype=torch.int64), minlength=vocab).to(
                out.dtype
            )
            out[i] -= frequency * counts + presence * (counts > 0).to(out.dtype)
    return out


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float]]) -> torch.Tensor:
    """`logits` with each row's logit_bias added (OpenAI's: token id -> bias, after the penalties,
    before temperature and the filters); `logits` itself where no row has one."""
    rows = [i for i, bias in enumerate(biases) if bias]
    if not rows:
        return logits
    out = logits.float().clone()
    for i in rows:
        ids = torch.tensor(list(biases[i]), dtype=torch.int64)
        out[i, ids] += torch.tensor(list(biases[i].values()), dtype=out.dtype)
    return out


def ban_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """`logits` with -inf at each row's banned ids (min_new_tokens keeping EOS and stop ids out);
    `logits` itself where no row bans any."""
    rows = [i for i, ids in enumerate(banned) if ids]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        out[i, torch.tensor(banned[i], dtype=torch.int64)] = float("-inf")
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets logits[r, t] to -inf, in place, for each r in `rows` whose bitmask row forbids token t:
    bitmask [bs, ceil(vocab / 32)] int32, bit i of word w allowing token 32 w + i. Plain tensor
    ops, so every rank (CPU or CUDA) masks the same entries; a grammar backend may bring a kernel
    that does the same (GrammarBackend.apply_bitmask_inplace)."""
    if not rows:
        return
    vocab = logits.shape[1]
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    words = bitmask.to(logits.device)[index]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    logits[index] = torch.where(allowed, logits[index], float("-inf"))


class Sampler:
    """Greedy rows take the argmax (the device's fused op where it has one), the others a seeded draw
    from filtered softmax. Holds no state of a step."""

    def __init__(self) -> None:
        self.ops = fused_ops()

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits [bs, vocab] (any float dtype) -> next token ids [bs] int64."""
        assert logits.dim() == 2 and logits.shape[0] == info.batch_size, (logits.shape, info.batch_size)
        if info.is_all_greedy:
            return self.ops.argmax(logits)
        is_greedy = info.temperatures == 0
        # Greedy rows divide by 1 to stay finite; their draw is replaced by the argmax below.
        temperatures = torch.where(is_greedy, 1.0, info.temperatures)
        probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)
        tokens = draw(filter_probs(probs, info), info.seeds, info.output_positions)
        if info.has_greedy:
            tokens = torch.where(is_greedy, self.ops.argmax(logits), tokens)
        return tokens


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p drop; the rest keep their relative weights.

    Each filter is a per-row probability threshold t (keep p >= t), so ties at a boundary are all
    kept and the result never depends on how a sort orders equal values. top-p is measured
    against the mass top-k kept; the most likely token always survives.
    """
    if not (info.need_top_k_top_p or info.need_min_p):
        return probs
    thresholds = probs.new_zeros(probs.shape[0])
    if info.need_top_k_top_p:
        sampled = info.temperatures > 0
        use_k = sampled & (info.top_ks > 0) & (info.top_ks < probs.shape[1])
        use_p = sampled & (info.top_ps < 1)
        thresholds = _top_k_top_p_thresholds(probs, info.top_ks, info.top_ps, use_k, use_p)
    if info.need_min_p:
        thresholds = torch.maximum(thresholds, info.min_ps * probs.amax(dim=-1))
    return probs.masked_fill(probs < thresholds[:, None], 0.0)


def _top_k_top_p_thresholds(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, use_k: torch.Tensor, use_p: torch.Tensor
) -> torch.Tensor:
    """[bs] thresholds from the largest probabilities of each row, without a full sort when the
    kept set is small: rows are searched in their top `width` values, and a row whose threshold
    might lie past that prefix is searched again in a wider one (the full row at the end)."""
    if probs.device.type != "cpu":
        return _thresholds_by_full_sort(probs, top_ks, top_ps, use_k, use_p)
    bs, vocab = probs.shape
    thresholds = probs.new_zeros(bs)
    todo = torch.nonzero(use_k | use_p).squeeze(1)
    width = _FIRST_PREFIX
    while todo.numel() > 0:
        width = vocab if width > vocab // 4 else width  # a wide partial sort costs as much as a full one
        rows = probs[todo]
        prefix = (
            torch.topk(rows, width, dim=-1).values
            if width < vocab
            else rows.sort(dim=-1, descending=True).values
        )
        found, resolved = _prefix_thresholds(prefix, top_ks[todo], top_ps[todo], use_k[todo], use_p[todo])
        if width == vocab:
            resolved = torch.ones_like(resolved)
        thresholds[todo[resolved]] = found[resolved]
        todo = todo[~resolved]
        width *= 8
    return thresholds


def _thresholds_by_full_sort(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, use_k: torch.Tensor, use_p: torch.Tensor
) -> torch.Tensor:
    """_top_k_top_p_thresholds from one full sort of every row: the same thresholds, with no
    data-dependent shapes, so a GPU step never waits on the host (a sort is cheap there; the CPU
    searches prefixes instead)."""
    found, _ = _prefix_thresholds(probs.sort(dim=-1, descending=True).values, top_ks, top_ps, use_k, use_p)
    return torch.where(use_k | use_p, found, 0.0)


def _prefix_thresholds(
    prefix: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, use_k: torch.Tensor, use_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds from each row's largest probabilities `prefix` [n, width] (descending), and
    whether the prefix was wide enough to be sure of them (the threshold lies above its last value)."""
    width = prefix.shape[1]
    cumulative = prefix.cumsum(dim=-1)
    before = F.pad(cumulative[:, :-1], (1, 0))  # mass strictly above each position; before[:, 0] == 0
    top_k_value = prefix.gather(1, (top_ks.clamp(1, width) - 1)[:, None]).squeeze(1)
    t_k = torch.where(use_k, top_k_value, 0.0)
    kept_by_k = (prefix >= t_k[:, None]).sum(dim=-1)  # >= 1
    mass = torch.where(use_k, cumulative.gather(1, (kept_by_k - 1)[:, None]).squeeze(1), 1.0)
    # Smallest prefix whose mass reaches top_p * mass: every position with less than that above it.
    kept_by_p = (before < (top_ps * mass)[:, None]).sum(dim=-1)  # >= 1
    t_p = torch.where(use_p, prefix.gather(1, (kept_by_p - 1)[:, None]).squeeze(1), 0.0)
    last = prefix[:, -1]
    # With top-k inside the prefix the top-p cut (never looser than top-k) is inside it too.
    resolved = torch.where(use_k, t_k > last, ~use_p | (t_p > last))
    return torch.maximum(t_k, t_p), resolved


def draw(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sample row i in proportion to weights [bs, vocab] (>= 0, one positive per row), as a pure
    function of (seeds[i], positions[i], weights[i]).

    Exponential race (argmax w / E, E ~ Exp(1) hashed from seed, position and index) in two
    levels: first a vocab block in proportion to its mass, then a token within that block. The
    product of the two is exactly w / sum(w), and only (vocab / block + block) uniforms are hashed
    per row instead of vocab.
    """
    bs, vocab = weights.shape
    num_blocks = -(-vocab // _BLOCK)
    padding = num_blocks * _BLOCK - vocab
    blocks = (F.pad(weights, (0, padding)) if padding else weights).reshape(bs, num_blocks, _BLOCK)
    keys = _row_keys(seeds, positions)  # [4, bs]
    block_ids = torch.arange(num_blocks, device=weights.device)
    block = _race(blocks.sum(dim=-1), keys[0], keys[1], block_ids[None, :])
    token_ids = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=weights.device)
    in_block = blocks[torch.arange(bs, device=weights.device), block]  # [bs, _BLOCK]
    return block * _BLOCK + _race(in_block, keys[2], keys[3], token_ids)


def _race(weights: torch.Tensor, key_a: torch.Tensor, key_b: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of weights / E with E ~ Exp(1) hashed from (row keys, ids)."""
    bits = _fmix32(_fmix32(key_a[:, None] ^ ids) ^ key_b[:, None])
    uniform = (bits.double() + 0.5) * 2.0**-32  # in (0, 1), exact in float64
    return (weights.double() / -torch.log(uniform)).argmax(dim=-1)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[4, bs] 32-bit keys: four salted lanes, each absorbing seed and position word by word."""
    keys = torch.tensor(_SALTS, dtype=torch.int64, device=seeds.device)[:, None].expand(4, seeds.shape[0])
    for word in (seeds & _MASK32, (seeds >> 32) & _MASK32, positions & _MASK32, (positions >> 32) & _MASK32):
        keys = _fmix32(keys ^ word)
    return keys


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 in 16-bit halves of c, so no int64 product exceeds 2**48 (no overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32
