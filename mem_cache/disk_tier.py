"""A tier of the radix cache on disk (`--enable-hierarchical-cache --hicache-storage-backend file`):
a prefix's KV in whole blocks of `block_tokens` tokens, one file per block and rank, kept across
restarts.

- A block's file name is the rank's identity (the model's files, the host's CPU and GPU and torch,
  dtype, quantization, attention backend, TP/PP shape and rank, page size, the pool's shape,
  `LAYOUT_VERSION`) and a hash of the
  namespace and every token id from the prompt's start to the block's end, so a file of another
  model, shape, rank, adapter or weight version is never opened. The header repeats both and is
  checked on read.
- Each file ends in a blake2b of all before it; it is written under a temporary name and renamed,
  so a reader sees a whole file or none. A short, corrupt or foreign file is a miss (and deleted).
- `read` is one rank's own view; the scheduler agrees the usable number of blocks over the world
  (MIN) before any rank uses one (scheduler/kv_manager.py), so ranks never disagree on a hit.
- Writes run on a background thread from copies taken once a prompt is computed and when its
  request ends; a full queue drops the write (the step never waits on the disk), and so does a
  process that exits before the writer is done (a miss later, never a bad file). Each rank bounds
  its own files to its share of `max_bytes`, the least recently used (written or read) first out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from mem_cache.kv_pool import PagedKVPool
from mem_cache.radix_cache import Namespace
from srt.default_model import default_model_path
from srt.server_args import DEFAULT_HICACHE_STORAGE_DIR, ServerArgs

logger = logging.getLogger("srt.disk_tier")

LAYOUT_VERSION = 1  # bump when a file's bytes or a block's KV would mean something else
MAGIC = b"SRTKV\x01\n"
SUFFIX = ".kv"
BLOCK_TOKENS = 64  # tokens per file, rounded up to whole KV pages
WRITE_QUEUE = 64  # requests' blocks waiting for the writer at most; past it a write is dropped
WRITE_QUEUE_BYTES = 2**30  # and their copies' bytes at most
STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died
_DIGEST = 32


def model_fingerprint(model_path: str | None) -> list[tuple[str, int, int]]:
    """What identifies the weights without reading them: every file under the model path (a
    directory or a .gguf file; None: the bundled model) by relative name, size and mtime in ns. A
    rewritten or replaced file changes it; a copy elsewhere (new mtimes) is a new identity."""
    path = Path(model_path or default_model_path()).expanduser().resolve()
    if path.is_file():
        st = path.stat()
        return [(path.name, st.st_size, st.st_mtime_ns)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def host_fingerprint(device: str) -> list[str]:
    """What of the host may change a kernel's bits: the CPU's model (its ISA picks the CPU
    kernels), torch's version, the GPU's name on CUDA. Stricter than needed (a directory shared by
    hosts of another CPU model is a miss there), never looser."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else ""
    return [platform.machine(), cpu, torch.__version__, gpu]


def rank_identity(args: ServerArgs, tp_rank: int, pp_rank: int) -> dict[str, object]:
    """What besides the tokens and the pool's layout (DiskTier adds it) decides one rank's KV bits."""
    return {
        "model": model_fingerprint(args.model_path),
        "host": host_fingerprint(args.device),
        "args": [
            args.dtype,
            args.device,
            args.quantization,
            args.attention_backend,
            args.deterministic,
            args.page_size,
        ],
        "shape": [args.tp_size, args.pp_size, tp_rank, pp_rank],
    }


@dataclass
class DiskStats:
    hit_tokens: int = 0  # tokens restored from disk (agreed over the world)
    read_blocks: int = 0  # blocks this rank read whole
    bad_blocks: int = 0  # short, corrupt or foreign files this rank deleted
    written_blocks: int = 0
    dropped_writes: int = 0  # requests whose blocks the full queue refused
    evicted_blocks: int = 0
    read_s: float = 0.0
    write_s: float = 0.0


@dataclass
class _Index:
    """This rank's files: name -> bytes, least recently used first."""

    files: OrderedDict[str, int] = field(default_factory=OrderedDict)
    total: int = 0


class DiskTier:
    """One rank's files in `directory`. `read` and `submit` run on the scheduler's thread; the
    writer thread owns the writes and shares the index with them under a lock."""

    def __init__(
        self,
        directory: str | Path,
        identity: dict[str, object],
        pool: PagedKVPool,
        max_bytes: int = 0,
        agree: Callable[[int], int] = lambda n: n,
    ) -> None:
        """`agree`: the MIN of an integer over the world (the identity at one rank)."""
        if pool.window_layers:
            raise ValueError("--enable-hierarchical-cache does not store sliding-window layers' pages yet")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--hicache-storage-dir {directory}: cannot create the directory: {e}") from e
        self.pool = pool
        self.block_tokens = -(-BLOCK_TOKENS // pool.page_size) * pool.page_size
        layout = {
            "layout": LAYOUT_VERSION,
            "dtype": str(pool.dtype),
            "pool": [pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size, self.block_tokens],
        }
        self.identity = json.dumps({**identity, **layout}, sort_keys=True).encode()
        self.prefix = hashlib.blake2b(self.identity, digest_size=8).hexdigest() + "-"
        self.max_bytes = max_bytes
        self.agree = agree
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._index = self._scan()
        self._pending: set[str] = set()  # names queued for the writer
        self._queued_bytes = 0  # of the copies queued
        self._queue: queue.Queue[tuple[list[str], list[torch.Tensor]] | None] = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="srt-disk-tier", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ keys
    def block_names(self, namespace: Namespace, token_ids: Sequence[int], num_blocks: int) -> list[str]:
        """The file names of the first `num_blocks` blocks of `token_ids`: each hashes the namespace
        and every token up to the block's end (ids as signed 64-bit: LongRoPE's keys are negative)."""
        h = hashlib.blake2b(self.identity, digest_size=_DIGEST)
        h.update(struct.pack("<2q", namespace.adapter, namespace.weight_version))
        names = []
        for b in range(num_blocks):
            block = token_ids[b * self.block_tokens : (b + 1) * self.block_tokens]
            h.update(struct.pack(f"<{len(block)}q", *block))
            names.append(self.prefix + h.copy().hexdigest() + SUFFIX)
        return names

    def known(self, name: str) -> bool:
        """Whether the block is on disk (as far as this rank knows) or queued for the writer."""
        with self._lock:
            return name in self._index.files or name in self._pending

    # ------------------------------------------------------------------ read
    def read(self, names: list[str]) -> list[torch.Tensor]:
        """The blocks of `names` this rank has whole, in order, up to the first it lacks: each
        [layers, 2, block_tokens, heads, head_dim] in the pool's dtype. A bad file is deleted."""
        start = time.perf_counter()
        blocks = []
        for name in names:
            block = self._read_one(name)
            if block is None:
                break
            blocks.append(block)
        self.stats.read_blocks += len(blocks)
        self.stats.read_s += time.perf_counter() - start
        return blocks

    def _read_one(self, name: str) -> torch.Tensor | None:
        path = self.directory / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # never written, or evicted by another server on the directory
            self._forget(name)
            return None
        except OSError as e:  # unreadable: a miss, never an error to the client
            logger.warning("disk tier: cannot read %s: %s", path, e)
            return None
        block = self._decode(name, data)
        if block is None:
            logger.warning("disk tier: %s is short, corrupt or foreign; deleted (a miss)", path)
            self.stats.bad_blocks += 1
            path.unlink(missing_ok=True)
            self._forget(name)
            return None
        with self._lock:
            if name not in self._index.files:
                self._index.total += len(data)
            self._index.files[name] = len(data)
            self._index.files.move_to_end(name)
        try:
            os.utime(path)  # the most recently used, for every server on the directory
        except OSError:
            pass  # deleted since (another server's eviction): the block read is whole all the same
        return block

    def _decode(self, name: str, data: bytes) -> torch.Tensor | None:
        header_at = len(MAGIC) + 4
        if len(data) < header_at + _DIGEST or not data.startswith(MAGIC):
            return None
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            return None
        (header_len,) = struct.unpack("<I", data[len(MAGIC) : header_at])
        try:
            header = json.loads(body[header_at : header_at + header_len])
        except ValueError:
            return None
        if header != {"identity": self.identity.decode(), "name": name}:
            return None
        payload = body[header_at + header_len :]
        shape = self._block_shape()
        if len(payload) != shape.numel() * self.pool.dtype.itemsize:
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw.view(self.pool.dtype).reshape(shape)

    def _block_shape(self) -> torch.Size:
        pool = self.pool
        return torch.Size((pool.num_layers, 2, self.block_tokens, pool.num_kv_heads, pool.head_dim))

    def load_into_pool(self, blocks: list[torch.Tensor], slots: torch.Tensor, skip: int = 0) -> None:
        """Writes the tokens of `blocks` (as `read` gave them) past their first `skip` into the
        pool's `slots`, one slot per token."""
        kv = torch.cat(blocks, dim=2)[:, :, skip : skip + len(slots)].to(self.pool.device)
        for layer in range(self.pool.num_layers):
            self.pool.set_kv_buffer(layer, slots, kv[layer, 0], kv[layer, 1])

    # ------------------------------------------------------------------ write
    def submit(self, names: list[str], slots: torch.Tensor) -> None:
        """Queues the blocks `names` whose KV is in `slots` (block_tokens each, in order) for the
        writer, copied now (the slots may be reused once this returns); those on disk already are
        skipped. Never blocks: a full queue drops the write."""
        todo = [i for i, name in enumerate(names) if not self.known(name)]
        if not todo:
            return
        t = self.block_tokens
        size = len(todo) * t * self.pool.num_layers * 2 * self.pool.num_kv_heads * self.pool.head_dim
        size *= self.pool.dtype.itemsize
        with self._lock:
            full = self._queued_bytes + size > WRITE_QUEUE_BYTES
        if full or self._queue.full():  # the host's memory and the step come first: a later miss
            self.stats.dropped_writes += 1
            return
        index = torch.cat([slots[i * t : (i + 1) * t] for i in todo])
        copies = []
        for layer in range(self.pool.num_layers):
            k, v = self.pool.get_kv_buffer(layer)
            copies.append(torch.stack([k.index_select(0, index), v.index_select(0, index)]).cpu())
        kv = torch.stack(copies)  # [layers, 2, tokens, heads, head_dim]
        blocks = [kv[:, :, j * t : (j + 1) * t] for j in range(len(todo))]
        queued = [names[i] for i in todo]
        with self._lock:  # before the writer can take them
            self._pending.update(queued)
            self._queued_bytes += size
        try:
            self._queue.put_nowait((queued, blocks))
        except queue.Full:
            self.stats.dropped_writes += 1
            with self._lock:
                self._pending.difference_update(queued)
                self._queued_bytes -= size

    def flush(self) -> None:
        """Waits until every queued write is on disk (tests; a graceful stop)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is not None:
                    for name, block in zip(*item):
                        self._write_one(name, block)
            except OSError as e:  # a full or read-only disk: the cache is only slower
                logger.warning("disk tier: a write failed: %s", e)
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.difference_update(item[0])
                        self._queued_bytes -= sum(block.nbytes for block in item[1])
                self._queue.task_done()

    def _write_one(self, name: str, block: torch.Tensor) -> None:
        with self._lock:
            if name in self._index.files:
                return
        start = time.perf_counter()
        header = json.dumps({"identity": self.identity.decode(), "name": name}).encode()
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        body = MAGIC + struct.pack("<I", len(header)) + header + payload
        data = body + hashlib.blake2b(body, digest_size=_DIGEST).digest()
        path = self.directory / name
        tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._index.files[name] = len(data)
            self._index.total += len(data)
        self.stats.written_blocks += 1
        self.stats.write_s += time.perf_counter() - start
        self._evict()

    # ------------------------------------------------------------------ index
    def _scan(self) -> _Index:
        """This rank's files on disk, oldest first; stale temporary files removed."""
        index = _Index()
        entries = []
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                Path(entry.path).unlink(missing_ok=True)
            elif entry.name.startswith(self.prefix) and entry.name.endswith(SUFFIX):
                entries.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(entries):
            index.files[name] = size
            index.total += size
        return index

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.files.pop(name, None)
            if size is not None:
                self._index.total -= size

    def _evict(self) -> None:
        """Deletes this rank's least recently used files until they fit in `max_bytes` (0: no bound)."""
        while True:
            with self._lock:
                if not self.max_bytes or self._index.total <= self.max_bytes or not self._index.files:
                    return
                name, size = self._index.files.popitem(last=False)
                self._index.total -= size
            (self.directory / name).unlink(missing_ok=True)
            self.stats.evicted_blocks += 1

    def clear(self) -> int:
        """Deletes this rank's files once the writes queued so far are done; returns how many."""
        self.flush()
        with self._lock:
            names = list(self._index.files)
            self._index = _Index()
        for name in names:
            (self.directory / name).unlink(missing_ok=True)
        logger.info("disk tier: %d files cleared", len(names))
        return len(names)

    def bytes_on_disk(self) -> int:
        with self._lock:
            return self._index.total

    def report(self) -> dict[str, object]:
        """This rank's counters and files, for /server_info's internal state."""
        with self._lock:
            files = len(self._index.files)
        return {**dataclasses.asdict(self.stats), "files": files, "bytes": self.bytes_on_disk()}


class _World(Protocol):
    def cpu_all_reduce_int(self, value: int) -> int: ...


class _Ranks(Protocol):
    """What the tier needs of the rank's process groups (model_executor's ParallelState)."""

    @property
    def tp_rank(self) -> int: ...
    @property
    def pp_rank(self) -> int: ...
    @property
    def world(self) -> _World: ...


def open_disk_tier(args: ServerArgs, ranks: _Ranks, pool: PagedKVPool) -> DiskTier | None:
    """The rank's disk tier, or None without `--enable-hierarchical-cache`; it agrees hits by a
    MIN over `ranks.world`."""
    if not args.disk_tier_on:
        return None
    directory = args.hicache_storage_dir or DEFAULT_HICACHE_STORAGE_DIR
    per_rank = args.hicache_max_bytes // args.world_size
    identity = rank_identity(args, ranks.tp_rank, ranks.pp_rank)
    tier = DiskTier(directory, identity, pool, per_rank, ranks.world.cpu_all_reduce_int)
    logger.info(
        "disk tier: %s, %d files (%.1f MB) of this rank's, blocks of %d tokens, bound %s",
        directory,
        len(tier._index.files),
        tier.bytes_on_disk() / 2**20,
        tier.block_tokens,
        f"{per_rank / 2**20:.0f} MB" if per_rank else "none",
    )
    return tier
