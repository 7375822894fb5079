"""Stable text and digests for event payloads, identical on every rank and in every process.

Python's `hash()` is salted per process and `repr()` of an arbitrary object may hold its memory
address, so neither can be compared across ranks. `canonical()` accepts only values whose text
is a pure function of their content and raises `TypeError` for anything else (map such values to
plain data with a selector function in `@rank_consensus`).

Dicts keep their iteration order (two ranks that built the same dict in different orders will
iterate it differently, which is exactly the hazard to catch); sets have no order, so their
elements are sorted by canonical text.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Sequence

_MASK63 = (1 << 63) - 1


def canonical(value: object) -> str:
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, enum.Enum):  # before int: IntEnum is an int
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)  # shortest round-trip text: exact and deterministic
    if isinstance(value, str | bytes):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ",".join(canonical(v) for v in value) + ",)"
    if isinstance(value, set | frozenset):
        return "{" + ",".join(sorted(canonical(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{canonical(k)}:{canonical(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={canonical(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    tolist = getattr(value, "tolist", None)  # torch tensors, numpy arrays and scalars
    if callable(tolist):
        return f"{type(value).__name__}:{canonical(tolist())}"
    raise TypeError(
        f"rank-consensus payload of type {type(value).__qualname__} has no stable canonical form; "
        "record plain data (str, int, float, enum, list, tuple, dict, set, dataclass) instead"
    )


def event_digest(name: str, text: str) -> int:
    """8-byte digest of one event as a signed int64 (what an int64 tensor holds)."""
    raw = hashlib.blake2b(f"{name}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def window_digest(start: int, digests: Sequence[int]) -> int:
    """Digest of the events [start, start + len(digests)), in [0, 2**63) so that -digest fits an
    int64 and one MIN all-reduce of [d, -d] yields both the MIN and the MAX."""
    h = hashlib.blake2b(digest_size=8)
    h.update(start.to_bytes(8, "little", signed=True))
    for d in digests:
        h.update(d.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & _MASK63
