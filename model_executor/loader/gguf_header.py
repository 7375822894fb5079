"""A GGUF file's header as the block loader needs it: its scalar metadata and where each tensor's
bytes lie, read in one pass over the header without building its arrays.

gguf-py's GGUFReader builds a numpy view for every element of every metadata array: a tokenizer's
150k-token vocabulary and merges take it seconds to parse before the first tensor is read. Here
an array is stepped over (a string array length by length) and only scalars are kept. The layout
(GGUF versions 2 and 3, little-endian): magic, version, tensor count, key-value count, the
key-values, then each tensor's name, dimensions (fastest-moving first), type and offset, the data
starting at the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> struct format, for the fixed-size ones (8 is a string, 9 an array)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as the file lists it: the fastest-moving dimension first
    tensor_type: int  # ggml's type number (gguf.GGMLQuantizationType)
    offset: int  # from the start of the file
    n_bytes: int


class GgufHeader:
    """`fields`: every scalar or string key-value (arrays left out); `tensors`: by GGUF name.
    `data(info)`: a tensor's bytes as a read-only uint8 array over the memory-mapped file."""

    def __init__(self, path: str | Path, type_sizes: dict[int, tuple[int, int]]) -> None:
        """type_sizes: ggml type -> (values a block, bytes a block), gguf.GGML_QUANT_SIZES."""
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, pos = self._map, 0

        def take(fmt: str) -> int | float | bool:
            nonlocal pos
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

        def skip(value_type: int, count: int) -> None:
            nonlocal pos
            if value_type == _STRING:
                for _ in range(count):
                    pos += 8 + int.from_bytes(buf[pos : pos + 8], "little")
            elif value_type == _ARRAY:
                for _ in range(count):
                    inner, n = struct.unpack_from("<IQ", buf, pos)
                    pos += 12
                    skip(inner, n)
            else:
                pos += struct.calcsize(_SCALARS[value_type]) * count

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version}; this reader takes 2 and 3")
        pos = 24
        self.fields: dict[str, int | float | bool | str] = {}
        for _ in range(n_fields):
            key = string()
            value_type = int(take("<I"))
            if value_type == _STRING:
                self.fields[key] = string()
            elif value_type == _ARRAY:
                inner, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                skip(inner, count)
            else:
                self.fields[key] = take(_SCALARS[value_type])
        listed = []
        for _ in range(n_tensors):
            name = string()
            dims = int(take("<I"))
            shape = struct.unpack_from(f"<{dims}Q", buf, pos)
            pos += 8 * dims
            tensor_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            listed.append((name, tuple(int(s) for s in shape), int(tensor_type), int(offset)))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, tensor_type, offset in listed:
            size, type_size = type_sizes.get(tensor_type, (0, 0))
            values = int(np.prod(shape)) if shape else 1
            n_bytes = values // size * type_size if size else 0
            self.tensors[name] = TensorInfo(name, shape, tensor_type, start + offset, n_bytes)

    def data(self, info: TensorInfo) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def read(self, info: TensorInfo, start: int, n_bytes: int) -> np.ndarray:
        """Bytes start .. start + n_bytes of a tensor, read into memory of their own (the map's pages
        would stay resident in this process, file-backed, as long as the map is open)."""
        with open(self.path, "rb", buffering=0) as f:
            out = np.empty(n_bytes, dtype=np.uint8)
            f.seek(info.offset + start)
            got = f.readinto(out.data)
        if got != n_bytes:
            raise ValueError(f"{self.path}: tensor {info.name} ends before its {info.n_bytes} bytes")
        return out
