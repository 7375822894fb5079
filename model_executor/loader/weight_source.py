"""Where weights come from: reading checkpoint tensors lazily (`--model-path` is resolved in
model_path.py).

A `LazyTensor` reads only what a layer's `weight_loader` asks for, so a tensor-parallel rank
touches just its own shard of each checkpoint tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The model's transformers config; ValueError when config.json is missing or unreadable."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"model_dir {str(model_dir)!r}: cannot read config.json: {error}") from error


class SafetensorsFile:
    """One safetensors file read with pread, not memory-mapped: what is read lands in the page
    cache and in the tensors made of it, never in the process's resident set as mapped pages (a
    mapped checkpoint counted whole in every rank's RSS while it loaded)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (size,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        header = json.loads(os.pread(self.fd, size, 8))
        header.pop("__metadata__", None)
        self.header: dict[str, Any] = header
        self.data_start = 8 + size

    def __del__(self) -> None:
        os.close(self.fd)

    def rows(
        self, name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, count: int
    ) -> torch.Tensor:
        """Rows start .. start + count (along the first dimension) of tensor `name`."""
        begin, _ = self.header[name]["data_offsets"]
        row = math.prod(shape[1:]) * dtype.itemsize
        data = bytearray(count * row)
        view = memoryview(data)
        offset, done = self.data_start + begin + start * row, 0
        while done < len(data):  # pread may return less than asked
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{self.path}: tensor {name} is cut short")
            done += got
        if not data:
            return torch.empty((count, *shape[1:]), dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).view(count, *shape[1:])


class LazyTensor:
    """One checkpoint tensor, read only when (and as far as) asked."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        file: SafetensorsFile | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        assert (file is None) != (tensor is None), "exactly one of file and tensor"
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self._file = file  # shared by the tensors of one file
        self._tensor = tensor

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor) -> LazyTensor:
        """Wrap an in-memory tensor (tests, synthetic weights) behind the same interface."""
        return cls(name, tuple(tensor.shape), tensor.dtype, tensor=tensor)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """`load().narrow(dim, start, length)`, reading only that slice's rows from disk."""
        if not -len(self.shape) <= dim < len(self.shape):
            raise ValueError(f"dim must be in [{-len(self.shape)}, {len(self.shape)}) for {self}, got {dim}")
        dim %= len(self.shape)
        size = self.shape[dim]
        if not 0 <= start <= size:
            raise ValueError(f"start must be in [0, {size}] for dim {dim} of {self}, got {start}")
        if not 0 <= length <= size - start:
            raise ValueError(
                f"length must be in [0, {size - start}] for start {start} of {self}, got {length}"
            )
        if self._tensor is not None:
            return self._tensor.narrow(dim, start, length)
        assert self._file is not None
        if dim == 0:
            return self._file.rows(self.name, self.dtype, self.shape, start, length)
        return self.load().narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        if self._tensor is not None:
            return self._tensor
        assert self._file is not None
        if not self.shape:  # a scalar
            return self._file.rows(self.name, self.dtype, (1,), 0, 1).view(())
        return self._file.rows(self.name, self.dtype, self.shape, 0, self.shape[0])


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files to read, sorted by name; those named by the index when there is one."""
    directory = Path(model_dir)
    index_file = directory / SAFETENSORS_INDEX
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"model_dir {str(model_dir)!r}: {SAFETENSORS_INDEX} has no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"model_dir {str(model_dir)!r}: {SAFETENSORS_INDEX} names missing files {missing}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir {str(model_dir)!r} holds no *.safetensors files")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[LazyTensor]:
    """Every tensor of every safetensors file, by file name then tensor name.

    Raises ValueError when there are no files or one tensor name appears in two files.
    """
    seen: dict[str, str] = {}
    for path in checkpoint_files(model_dir):
        try:
            handle = SafetensorsFile(path)
        except (OSError, ValueError, struct.error) as error:
            raise ValueError(f"{path}: not a readable safetensors file: {error}") from error
        for name in sorted(handle.header):
            if name in seen:
                raise ValueError(
                    f"model_dir {str(model_dir)!r}: tensor {name} is in both {seen[name]} and {path.name}"
                )
            seen[name] = path.name
            info = handle.header[name]
            shape = tuple(int(n) for n in info["shape"])
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            yield LazyTensor(name, shape, dtype, file=handle)


def eos_token_ids(model_dir: Path, hf_config: Any) -> set[int]:
    """Every id that ends generation: the config's eos_token_id and generation_config.json's."""
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except (OSError, ValueError):
        pass
    for eos in candidates:
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ids
