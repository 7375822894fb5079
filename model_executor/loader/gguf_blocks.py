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
from typing import Any

import gguf
import numpy as np
import torch

from model_executor.loader.gguf_header import GgufHeader, TensorInfo


@dataclass(frozen=True)
class Blocks:
    form: str  # "q4_1", "q4_k", "q8" or "q6_k"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None  # q4_1 and q4_k only
    # A K-quant file's super-block factors, d and m per run being their products (exact): for q4_k
    # (D, sc, M, mn), D and M float32 [n, k/256] (the file's d and -dmin), sc and mn uint8 [n, k/32]
    # (six bits); for q6_k (D, sc), sc int8 [n, k/16]. None where not known (packing finds them).
    factors: tuple[torch.Tensor, ...] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def rows(self, index: torch.Tensor | slice) -> Blocks:
        """These blocks with their rows taken in `index`'s order (or a slice of them)."""
        m = None if self.m is None else self.m[index]
        factors = None if self.factors is None else tuple(f[index] for f in self.factors)
        return Blocks(self.form, self.q[index], self.d[index], m, factors)

    # A weight loader narrows blocks as it narrows a tensor (layers/sharding.py's TensorSource):
    # rows anywhere, columns at a multiple of 32.

    def narrow(self, dim: int, start: int, length: int) -> Blocks:
        if dim % 2 == 0:
            return self.rows(slice(start, start + length))
        if start % 32 or length % 32:
            raise ValueError(f"blocks narrow along k at multiples of 32, got {start} + {length}")
        return _columns(self, start, length)

    def index_select(self, dim: int, index: torch.Tensor) -> Blocks:
        assert dim == 0, "blocks take rows by index"
        return self.rows(index)

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
        factors = (
            d.view(n, k // 256),
            sc.reshape(n, k // 32),
            -dmin.view(n, k // 256),
            mn.reshape(n, k // 32),
        )
        return Blocks("q4_k", q.reshape(n, k), dsub, msub, factors)
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
        sc = raw[:, 192:208].contiguous().view(torch.int8)
        return Blocks(
            "q6_k",
            q,
            (d[:, None] * scales).reshape(n, k // 16),
            None,
            (d.view(n, k // 256), sc.reshape(n, k // 16)),
        )
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
    factors = None
    if all(p.factors is not None for p in parts):
        factors = tuple(torch.cat(f) for f in zip(*(p.factors for p in parts if p.factors is not None)))
    return Blocks(first.form, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, factors)


FORMS = {  # ggml type -> the form _decode gives its blocks
    int(gguf.GGMLQuantizationType.Q4_1): "q4_1",
    int(gguf.GGMLQuantizationType.Q4_K): "q4_k",
    int(gguf.GGMLQuantizationType.Q5_K): "q4_k",
    int(gguf.GGMLQuantizationType.Q8_0): "q8",
    int(gguf.GGMLQuantizationType.Q5_0): "q8",
    int(gguf.GGMLQuantizationType.Q4_0): "q8",
    int(gguf.GGMLQuantizationType.Q6_K): "q6_k",
}


@dataclass(frozen=True)
class FileRows:
    """Rows of a file tensor as the file holds them, [rows, k / block values * block bytes] uint8,
    decoded only when asked (`blocks`): a device may lay them out for its kernels straight from the
    file's bytes. Narrowed like Blocks; along k at whole blocks, else decoded first."""

    ggml_type: int
    raw: torch.Tensor
    k: int
    block: tuple[int, int]  # (values, bytes) a block

    @property
    def form(self) -> str:
        return FORMS[self.ggml_type]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.raw.shape[0]), self.k)

    def blocks(self) -> Blocks:
        blocks = _decode(self.ggml_type, self.raw.reshape(-1, self.block[1]), self.shape[0], self.k)
        assert blocks is not None
        return blocks

    def narrow(self, dim: int, start: int, length: int) -> FileRows | Blocks:
        if dim % 2 == 0:
            return FileRows(self.ggml_type, self.raw[start : start + length], self.k, self.block)
        values, size = self.block
        if start % values or length % values:
            return self.blocks().narrow(1, start, length)
        raw = self.raw[:, start // values * size : (start + length) // values * size]
        return FileRows(self.ggml_type, raw, length, self.block)

    def index_select(self, dim: int, index: torch.Tensor) -> FileRows:
        assert dim == 0, "rows by index"
        return FileRows(self.ggml_type, self.raw[index], self.k, self.block)


def join_rows(parts: list[FileRows]) -> FileRows | None:
    """The parts stacked row-wise where they are of one type and width, else None."""
    first = parts[0]
    if any(p.ggml_type != first.ggml_type or p.k != first.k for p in parts):
        return None
    return FileRows(first.ggml_type, torch.cat([p.raw for p in parts]), first.k, first.block)


class BlockTensor:
    """A file tensor as a weight loader's source (load_weights' NamedTensorSource) whose narrow
    gives blocks, not values: the rows asked for decoded from the memory-mapped file, nothing else.
    Row i is the file's row order[i] (the checkpoint's order, GgufFile.row_order), or row i."""

    def __init__(self, name: str, file: GgufFile, order: np.ndarray | None = None) -> None:
        self.name, self.file, self.order = name, file, order
        tensor = file.tensor(name)
        assert tensor is not None and tensor.tensor_type in FORMS, name
        self.info = tensor
        self.shape = (tensor.shape[1], tensor.shape[0])  # [n, k]: gguf lists k first
        self.ggml_type = tensor.tensor_type  # the file's block type (gguf.GGMLQuantizationType)

    @property
    def form(self) -> str:
        return FORMS[self.ggml_type]

    def narrow(self, dim: int, start: int, length: int) -> FileRows | Blocks:
        n, k = self.shape
        if dim % 2 == 1:
            return self.narrow(0, 0, n).narrow(1, start, length)
        size, type_size = self.file.type_sizes[self.info.tensor_type]
        row_bytes = (k // size) * type_size
        wanted = (
            np.arange(start, start + length) if self.order is None else self.order[start : start + length]
        )
        first = int(wanted.min()) if length else 0
        span = int(wanted.max()) - first + 1 if length else 0  # the rows between the first and last asked
        raw = self.file.header.read(self.info, first * row_bytes, span * row_bytes).reshape(span, row_bytes)
        rows = raw if self.order is None else raw[wanted - first]
        return FileRows(self.ggml_type, torch.from_numpy(rows), k, (size, type_size))


class GgufFile:
    """A GGUF file's tensors by their Hugging Face names (gguf-py's name map for its architecture),
    its header read by gguf_header (gguf-py's reader parses every metadata array first)."""

    def __init__(self, path: str | Path, config: dict[str, Any] | None = None) -> None:
        """config: the Hugging Face config the file was converted with (gguf_convert.py), for
        `source`."""
        self.path = Path(path)
        self.config = config
        self.type_sizes = {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()}  # (values, bytes) a block
        self.header = GgufHeader(self.path, self.type_sizes)
        arch_name = str(self.header.fields.get("general.architecture", ""))
        arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
        self.arch = arch_name
        layers = self.header.fields.get(f"{arch_name}.block_count")
        self.names = gguf.get_tensor_name_map(arch, int(layers)) if arch is not None and layers else None

    def tensor(self, hf_name: str) -> TensorInfo | None:
        """The 2-D tensor behind `hf_name` (a weight's name, ".weight" included) in a type of whole
        blocks of 32 values or more, or None."""
        if self.names is None:
            return None
        name = self.names.get_name(hf_name, try_suffixes=(".weight",))
        tensor = self.header.tensors.get(name) if name is not None else None
        if tensor is None or len(tensor.shape) != 2:
            return None
        size, _ = self.type_sizes.get(tensor.tensor_type, (0, 0))
        return tensor if size >= 32 and tensor.shape[0] % size == 0 else None

    def block_tensor(self, hf_name: str) -> BlockTensor | None:
        """The tensor behind `hf_name` as a source of blocks in the file's row order, or None where it
        has no block form."""
        tensor = self.tensor(hf_name)
        return BlockTensor(hf_name, self) if tensor is not None and tensor.tensor_type in FORMS else None

    def source(self, hf_name: str) -> BlockTensor | None:
        """The tensor behind `hf_name` as a source of blocks in the checkpoint's row order (row_order),
        or None where it has no block form or its rows are not a reordering of the file's."""
        tensor = self.tensor(hf_name)
        if tensor is None or tensor.tensor_type not in FORMS:
            return None
        order = self.row_order(tensor)
        if order is None or order is False:
            return None
        return BlockTensor(hf_name, self, None if order is True else order)

    def row_order(self, tensor: TensorInfo) -> np.ndarray | bool | None:
        """Which file row each row of the converted checkpoint's tensor is: transformers' processor
        for the architecture (the converter's, gguf_convert.py) run on the row numbers. True: the
        file's order; None: not a reordering of rows (or no config to run it with)."""
        if self.config is None:
            return None
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        processor = TENSOR_PROCESSORS.get(self.arch, TensorProcessor)(config=self.config)
        n = tensor.shape[1]
        numbers = np.arange(n, dtype=np.float64)[:, None]
        result = processor.process(
            weights=numbers,
            name=tensor.name,
            tensor_key_mapping={},
            parsed_parameters={"config": self.config, "tensors": {}},
        )
        order = np.asarray(result.weights)
        if order.shape != (n, 1) or not np.array_equal(np.sort(order[:, 0]), numbers[:, 0]):
            return None
        order = order[:, 0].astype(np.int64)
        return True if np.array_equal(order, np.arange(n)) else order

    def blocks(self, hf_name: str) -> Blocks | None:
        """The tensor behind `hf_name` as blocks in the file's row order, or None where the file has
        no such tensor or holds it in a type without a block form here."""
        source = self.block_tensor(hf_name)
        if source is None:
            return None
        rows = source.narrow(0, 0, source.shape[0])
        return rows.blocks() if isinstance(rows, FileRows) else rows


def _row_keys(values: torch.Tensor) -> list[bytes]:
    """Each row of a bf16 [n, c] tensor as bytes."""
    raw = values.contiguous().view(torch.uint8).numpy()
    return [row.tobytes() for row in raw]


def _columns(blocks: Blocks, start: int, width: int) -> Blocks:
    """Columns start .. start + width (multiples of 32) of the blocks."""
    per = 16 if blocks.form == "q6_k" else 32
    d = blocks.d[:, start // per : (start + width) // per]
    m = None if blocks.m is None else blocks.m[:, start // 32 : (start + width) // 32]
    factors = None
    if blocks.factors is not None and start % 256 == 0 and width % 256 == 0:  # whole super-blocks
        factors = tuple(
            f[:, start * f.shape[1] // blocks.shape[1] : (start + width) * f.shape[1] // blocks.shape[1]]
            for f in blocks.factors
        )
    return Blocks(blocks.form, blocks.q[:, start : start + width], d, m, factors)


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
