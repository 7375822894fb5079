"""A GGUF file's quantized weights read straight from its blocks (the file memory-mapped): each
tensor as the few arrays a kernel needs, without dequantizing it.

`Blocks` is one of four forms, each exact (float32(d q + m), or float32(d q), is gguf-py's and
llama.cpp's dequantized value, every product exact in float32):
- "q4_1": q uint8 [n, k] in 0..15, d and m fp16 [n, k/32] (Q4_1)
- "q4_k": q uint8 [n, k] in 0..31, d and m float32 [n, k/32] (Q4_K, Q5_K: d sc and -dmin mn per
  run of 32; Q4_1 widened)
- "q8": q int8 [n, k], d fp16 [n, k/32] (Q8_0; Q5_0 and Q4_0, q less 16 or 8)
- "q6_k": q int8 [n, k] in -128..127, d float32 [n, k/16] (Q6_K: d sc per run of 16; q8 widened)

Parts of one merged weight (q, k and v; gate and up) are joined row-wise where one form holds them
all (`join`). The CPU wing lays these out for its kernels (cpu/kernels/packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from model_executor.loader.gguf_header import GgufHeader


@dataclass(frozen=True)
class Blocks:
    form: str  # "q4_1", "q4_k", "q8" or "q6_k"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None  # q4_1 and q4_k only

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def rows(self, index: torch.Tensor) -> Blocks:
        """These blocks with their rows taken in `index`'s order."""
        m = None if self.m is None else self.m[index]
        return Blocks(self.form, self.q[index], self.d[index], m)

    def dequantize(self) -> torch.Tensor:
        """The float32 values, as gguf-py computes them."""
        n, k = self.shape
        q = self.q.float().view(n, -1, 16 if self.form == "q6_k" else 32)
        w = self.d.float()[..., None] * q
        if self.m is not None:
            w = w + self.m.float()[..., None]
        return w.view(n, k)


def _u16(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """Little-endian fp16 at `offset` of each block ([blocks, bytes] uint8) as float32 [blocks]."""
    return raw[:, offset : offset + 2].contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[.., 16] bytes -> [.., 32]: the low nibbles, then the high ones (ggml's Q4_0/Q4_1/Q5_0 order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _bits(words: torch.Tensor) -> torch.Tensor:
    """[b, n] bytes -> [b, 8 n] uint8: bit i of byte j at 8 j + i."""
    return ((words[:, :, None] >> _SHIFTS) & 1).reshape(words.shape[0], -1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant super-block's 12 scale bytes [b, 12] -> its 8 six-bit scales and mins [b, 8]
    (ggml's get_scale_min_k4)."""
    s = scales
    low_sc, low_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    high_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], 1), torch.cat([low_m, high_m], 1)


def _decode(kind: int, raw: torch.Tensor, n: int, k: int) -> Blocks | None:
    """raw: the tensor's bytes as [blocks, block bytes] uint8, row-major over [n, k]."""
    T = gguf.GGMLQuantizationType
    if kind == T.Q8_0:
        q = raw[:, 2:34].contiguous().view(torch.int8)
        return Blocks("q8", q.reshape(n, k), raw[:, 0:2].contiguous().view(torch.float16).reshape(n, k // 32))
    if kind in (T.Q4_0, T.Q5_0):
        d = raw[:, 0:2].contiguous().view(torch.float16).reshape(n, k // 32)
        if kind == T.Q4_0:
            q = _nibbles(raw[:, 2:18]).to(torch.int16) - 8
        else:
            high = _bits(raw[:, 2:6])  # element j's fifth bit: bit j of the little-endian word
            q = (_nibbles(raw[:, 6:22]) | (high << 4)).to(torch.int16) - 16
        return Blocks("q8", q.to(torch.int8).reshape(n, k), d)
    if kind == T.Q4_1:
        d = raw[:, 0:2].contiguous().view(torch.float16).reshape(n, k // 32)
        m = raw[:, 2:4].contiguous().view(torch.float16).reshape(n, k // 32)
        return Blocks("q4_1", _nibbles(raw[:, 4:20]).reshape(n, k), d, m)
    if kind in (T.Q4_K, T.Q5_K):
        b = raw.shape[0]
        d, dmin = _u16(raw, 0), _u16(raw, 2)
        sc, mn = _k_scales(raw[:, 4:16])
        qs = raw[:, 16:144] if kind == T.Q4_K else raw[:, 48:176]
        chunks = qs.reshape(b, 4, 32)  # chunk j: sub-block 2j in the low nibbles, 2j + 1 in the high
        q = torch.stack([chunks & 15, chunks >> 4], dim=2).reshape(b, 256)
        if kind == T.Q5_K:
            qh = raw[:, 16:48]  # bit i of byte l: the fifth bit of sub-block i's element l
            fifth = (qh[:, None, :] >> _SHIFTS[None, :, None]) & 1  # [b, 8, 32]
            q = q | (fifth.reshape(b, 256) << 4)
        dsub = (d[:, None] * sc.float()).reshape(n, k // 32)  # exact: fp16 times six bits
        msub = -(dmin[:, None] * mn.float()).reshape(n, k // 32)
        return Blocks("q4_k", q.reshape(n, k), dsub, msub)
    if kind == T.Q6_K:
        b = raw.shape[0]
        ql, qh = raw[:, 0:128].reshape(b, 2, 64), raw[:, 128:192].reshape(b, 2, 32)
        scales = raw[:, 192:208].contiguous().view(torch.int8).float()  # [b, 16]
        d = _u16(raw, 208)
        low = torch.stack(
            [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=2
        )  # [b, half, 4, 32]
        high = (qh[:, :, None, :] >> (2 * _SHIFTS[:4])[None, None, :, None]) & 3
        q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, k)  # 0..63, so the view is exact
        return Blocks("q6_k", q, (d[:, None] * scales).reshape(n, k // 16))
    return None


def _widen(blocks: Blocks, form: str) -> Blocks:
    """The same values in a wider form: q4_1 -> q4_k (float32 d, m), q8 -> q6_k (d per 16)."""
    if blocks.form == form:
        return blocks
    if form == "q4_k":
        assert blocks.form == "q4_1" and blocks.m is not None
        return Blocks(form, blocks.q, blocks.d.float(), blocks.m.float())
    assert blocks.form == "q8" and form == "q6_k"
    return Blocks(form, blocks.q, blocks.d.float().repeat_interleave(2, dim=1))


def join(parts: list[Blocks]) -> Blocks | None:
    """The parts stacked row-wise in one form, or None where no form holds them all (a 4-bit
    part with a minimum beside an 8-bit one)."""
    forms = {p.form for p in parts}
    if len(forms) > 1:
        if forms <= {"q4_1", "q4_k"}:
            form = "q4_k"
        elif forms <= {"q8", "q6_k"}:
            form = "q6_k"
        else:
            return None
        parts = [_widen(p, form) for p in parts]
    first = parts[0]
    if len(parts) == 1:
        return first
    m = None if first.m is None else torch.cat([p.m for p in parts if p.m is not None])
    return Blocks(first.form, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


class GgufFile:
    """A GGUF file's tensors by their Hugging Face names (gguf-py's name map for its architecture),
    its header read by gguf_header (gguf-py's reader parses every metadata array first)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.type_sizes = {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()}  # (values, bytes) a block
        self.header = GgufHeader(self.path, self.type_sizes)
        arch_name = str(self.header.fields.get("general.architecture", ""))
        arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
        self.arch = arch_name
        layers = self.header.fields.get(f"{arch_name}.block_count")
        self.names = gguf.get_tensor_name_map(arch, int(layers)) if arch is not None and layers else None

    def blocks(self, hf_name: str) -> Blocks | None:
        """The tensor behind `hf_name` (a weight's name, ".weight" included) as blocks, or None where
        the file has no such tensor or holds it in a type without a block form here."""
        if self.names is None:
            return None
        name = self.names.get_name(hf_name, try_suffixes=(".weight",))
        tensor = self.header.tensors.get(name) if name is not None else None
        if tensor is None or len(tensor.shape) != 2:
            return None
        k, n = tensor.shape  # gguf lists the fastest-moving dimension first
        size, type_size = self.type_sizes.get(tensor.tensor_type, (0, 0))
        if size < 32 or k % size:
            return None
        raw = torch.from_numpy(self.header.data(tensor).reshape(-1, type_size).copy())  # the map is read-only
        return _decode(tensor.tensor_type, raw, n, k)


def _row_keys(values: torch.Tensor) -> list[bytes]:
    """Each row of a bf16 [n, c] tensor as bytes."""
    raw = values.contiguous().view(torch.uint8).numpy()
    return [row.tobytes() for row in raw]


def _columns(blocks: Blocks, start: int, width: int) -> Blocks:
    """Columns start .. start + width (multiples of 32) of the blocks."""
    per = 16 if blocks.form == "q6_k" else 32
    d = blocks.d[:, start // per : (start + width) // per]
    m = None if blocks.m is None else blocks.m[:, start // 32 : (start + width) // 32]
    return Blocks(blocks.form, blocks.q[:, start : start + width], d, m)


def blocks_of_weight(weight: torch.Tensor, whole: Blocks, samples: int = 16) -> Blocks | None:
    """The blocks behind `weight` (a bf16 [n, k] parameter loaded from the file's dequantized
    values, in whatever row order and shard the model keeps: q and k rows permuted for its rotary
    layout, a tensor-parallel rank's rows or columns), found in `whole` (the file's tensor, or its
    parts joined): rows matched by their first 64 values rounded to bf16 (rows alike there, as a
    vocabulary's unused tokens, by their whole values), the column shard at a multiple of the
    shard's width. None where that leaves a row unmatched, or where `samples` rows spread over the
    weight do not round to its values exactly."""
    n, k = weight.shape
    rows, columns = whole.shape
    if weight.dtype != torch.bfloat16 or k % 32 or columns % k or n > rows:
        return None
    head = min(64, k)
    wanted = _row_keys(weight[:, :head])
    for start in range(0, columns, k):
        part = _columns(whole, start, k)
        keys = _row_keys(_columns(part, 0, 32 * -(-head // 32)).dequantize()[:, :head].bfloat16())
        found: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            found.setdefault(key, []).append(i)
        index = _match(weight, part, wanted, found)
        if index is None:
            continue
        picked = part if index == list(range(rows)) else part.rows(torch.tensor(index))
        check = torch.linspace(0, n - 1, min(samples, n)).long()
        if torch.equal(picked.rows(check).dequantize().bfloat16(), weight[check]):
            return picked
    return None


def _match(
    weight: torch.Tensor, part: Blocks, wanted: list[bytes], found: dict[bytes, list[int]]
) -> list[int] | None:
    """The file row of each row of `weight` (by key; where several share a key, by their whole
    values), or None where some row has none."""
    index: list[int | None] = [None] * len(wanted)
    shared: dict[bytes, list[int]] = {}  # a key several file rows share: the weight's rows with it
    for row, key in enumerate(wanted):
        candidates = found.get(key)
        if not candidates:
            return None
        if len(candidates) == 1:
            index[row] = candidates[0]
        else:
            shared.setdefault(key, []).append(row)
    for key, rows in shared.items():
        candidates = found[key]
        if len(candidates) > 4096:
            return None
        whole = dict(zip(_row_keys(part.rows(torch.tensor(candidates)).dequantize().bfloat16()), candidates))
        for row, full in zip(rows, _row_keys(weight[rows])):
            index[row] = whole.get(full)
    return None if any(i is None for i in index) else [i for i in index if i is not None]
