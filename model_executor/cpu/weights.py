"""A loaded model's weights laid out for the CPU kernels, once at start-up (the CPU wing's
prepare_weights): every linear layer's weight packed for the kernel that multiplies by it
(cpu/linear.py), as int8 with --quantization w8a8_int8, as a GGUF file's own blocks (Q4_1, Q4_K,
Q5_K, Q8_0, Q5_0, Q4_0, Q6_K, and a Q8_0 LM head) with --quantization gguf."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model_executor.cpu.kernels import build, packing
from model_executor.cpu.linear import (
    PackedLinearMethod,
    PackedWeight,
    pack_blocks,
    pack_weight,
    packed_of,
    reads_dense,
    set_one_arithmetic,
)
from model_executor.cpu.memory import release_freed_memory
from model_executor.cpu.moe import fuse_experts
from model_executor.layers.linear import LinearBase
from model_executor.layers.linear_method import UNQUANTIZED
from model_executor.loader.gguf_blocks import (
    FORMS,
    BlockTensor,
    FileRows,
    GgufFile,
    blocks_of_weight,
    join,
    join_rows,
)
from model_executor.loader.gguf_blocks import Blocks as FileBlocks
from model_executor.loader.load_weights import LoadHooks, NamedTensorSource

logger = logging.getLogger("srt.model_runner")  # the start-up lines keep the logger they always had

QUANTIZATIONS = ("w8a8_int8", "gguf")


def check_quantization(quantization: str | None, dtype: torch.dtype, device: str) -> None:
    """Raises ValueError naming what --quantization needs and this process lacks."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device != "cpu" or dtype != torch.bfloat16:
        raise ValueError(
            f"--quantization {quantization} runs on --device cpu with bfloat16 activations; "
            f"got {device} with {dtype}"
        )
    if quantization == "gguf":
        if not (build.bf16_linear_available() and (build.q4_available() or build.q8_available())):
            raise ValueError(
                "--quantization gguf needs the CPU kernels built and a CPU with AVX-512 BF16 (AMD Zen 4 or "
                "later, Intel Cooper Lake or later) or AVX2, FMA and F16C (Q4_1 layers and a Q8_0 LM "
                "head); this process has neither"
            )
        return
    if not build.int8_available():
        raise ValueError(
            f"--quantization {quantization} needs a CPU with AMX int8 tiles (Intel Xeon 4th "
            "generation or later) or AVX-512 VNNI (AMD Zen 4 or later, Intel Ice Lake or later) "
            "and the CPU kernels built; this process has neither"
        )


def gguf_bf16_reason() -> str:
    """Why a --quantization gguf layer stays bf16 on this CPU, as pack_model logs it."""
    eight = ", Q8_0, Q5_0, Q4_0 or Q6_K" if build.q8_available() else ""
    if build.q5k_available():  # wherever Q4_1's kernel runs (cpu_q4_linear.c: both ISA paths)
        return f"not Q4_1, Q4_K, Q5_K{eight} (another type)"
    return "no 4-bit kernel on this CPU"


Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, d, m


def gguf_blocks(
    exact: torch.Tensor, quantizable: bool
) -> tuple[Blocks | None, Blocks | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the Q4_1 or Q4_K blocks, the Q5_K blocks, the Q8_0, Q5_0, Q4_0 or Q6_K blocks) of a layer's
    exact float32 weight that this CPU has a kernel for, each None where the weight is not so or the
    kernel is missing; at most one is found. The 4-bit ones, Q5_K and Q6_K only for a quantizable
    layer (the LM head is not: it runs Q8_0-style blocks only). Q6_K's come as q8_recover's form
    with float32 D, one per 16 k. Q4_K before Q5_K: a Q4_K weight is a Q5_K one too."""
    q4 = packing.q4_recover(exact) if quantizable and build.q4_available() else None
    if quantizable and q4 is None and build.q4k_available():
        q4 = packing.q4k_recover(exact)
    q8 = packing.q8_recover(exact) if q4 is None and build.q8_available() else None
    q5 = None
    if quantizable and q4 is None and q8 is None and build.q5k_available():
        q5 = packing.q5k_recover(exact)
    if quantizable and q4 is None and q5 is None and q8 is None and build.q8_available():
        q8 = packing.q6k_recover(exact)
    return q4, q5, q8


KernelBlocks = tuple[Blocks | None, Blocks | None, tuple[torch.Tensor, torch.Tensor] | None]


def kernel_blocks(blocks: FileBlocks, quantizable: bool) -> KernelBlocks:
    """gguf_blocks' triple for blocks read from the file (loader/gguf_blocks.py): the 4-bit ones
    (Q4_1; Q4_K and Q5_K whose q fit in 4 bits), Q5_K's, or the 8-bit kernel's (Q8_0, Q5_0, Q4_0,
    Q6_K), each where this CPU has its kernel; only the 8-bit ones where not `quantizable` (the LM
    head, whose float32 logits the 8-bit kernel writes)."""
    if blocks.form in ("q8", "q6_k"):
        return None, None, ((blocks.q, blocks.d) if build.q8_available() else None)
    if not quantizable or blocks.m is None:
        return None, None, None
    triple = (blocks.q, blocks.d, blocks.m)
    if blocks.form == "q4_1":
        return (triple if build.q4_available() else None), None, None
    if int(blocks.q.max()) <= 15 and build.q4k_available():
        return triple, None, None
    return None, (triple if build.q5k_available() else None), None


def file_blocks(model: nn.Module, file: GgufFile) -> Callable[[str, LinearBase], KernelBlocks]:
    """The blocks of each linear layer read from `file`: its checkpoint weights (q, k and v of a
    qkv_proj, as the model's packed_modules_mapping merges them; a tied LM head's token embedding)
    joined, then matched to the layer's loaded weight (gguf_blocks.blocks_of_weight)."""
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})

    def parts(name: str) -> list[list[str]]:
        prefix, _, leaf = name.rpartition(".")
        merged = [ckpt for ckpt, (param, _) in mapping.items() if param == leaf]
        names = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in merged or [leaf]]
        if leaf == "lm_head":  # tied: the token embedding
            return [names, ["model.embed_tokens.weight"]]
        return [names]

    def blocks_of(name: str, module: LinearBase) -> KernelBlocks:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        for names in parts(name):
            found = [file.blocks(n) for n in names]
            whole = join([b for b in found if b is not None]) if all(found) else None
            picked = blocks_of_weight(weight, whole) if whole is not None else None
            if picked is not None:
                return kernel_blocks(picked, getattr(module, "quantizable", True))
        return None, None, None

    return blocks_of


def _family(form: str) -> str:
    return "4-bit" if form in ("q4_1", "q4_k") else "8-bit"


Segments = list[tuple[int, KernelBlocks]]  # a merged weight's runs of rows, each on one block kind


def file_segments(model: nn.Module, file: GgufFile) -> Callable[[str, LinearBase], Segments | None]:
    """For a qkv_proj whose parts no one block form holds (llama.cpp's Q4_K_M keeps v in Q6_K beside
    Q4_K q and k in half its layers): each run of parts one form holds, as (its rows on this rank,
    kernel_blocks' triple of its blocks matched to those rows of the loaded weight); None where a run
    is not found or has no kernel here, or the parts join (file_blocks finds those)."""
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})

    def segments_of(name: str, module: LinearBase) -> Segments | None:
        weight = module.weight
        q_size, kv_size = getattr(module, "q_size", 0), getattr(module, "kv_size", 0)
        if not (isinstance(weight, torch.Tensor) and q_size and kv_size):
            return None
        rows = {"q": q_size, "k": kv_size, "v": kv_size}
        prefix, _, leaf = name.rpartition(".")
        merged = [
            (ckpt, shard) for ckpt, (param, shard) in mapping.items() if param == leaf and shard in rows
        ]
        found = [file.blocks(f"{prefix}.{ckpt}.weight") for ckpt, _ in merged]
        if len(found) < 2 or any(b is None for b in found):
            return None
        runs: list[tuple[list[FileBlocks], int]] = []  # parts one form holds, and their rows here
        for blocks, (_, shard) in zip(found, merged):
            assert blocks is not None
            if runs and _family(runs[-1][0][0].form) == _family(blocks.form):
                runs[-1] = ([*runs[-1][0], blocks], runs[-1][1] + rows[str(shard)])
            else:
                runs.append(([blocks], rows[str(shard)]))
        if len(runs) < 2 or sum(n for _, n in runs) != weight.shape[0]:
            return None
        segments: Segments = []
        start = 0
        for parts, n in runs:
            whole = join(parts)
            picked = blocks_of_weight(weight[start : start + n], whole) if whole is not None else None
            triple = kernel_blocks(picked, True) if picked is not None else (None, None, None)
            if all(t is None for t in triple):
                return None
            segments.append((n, triple))
            start += n
        return segments

    return segments_of


def recovered_blocks(float32_model: nn.Module) -> Callable[[str, LinearBase], KernelBlocks]:
    """The blocks of each linear layer recovered from the same layer of `float32_model` (the
    checkpoint loaded in float32: its exact dequantized values; gguf_blocks)."""
    float32_modules = dict(float32_model.named_modules())

    def blocks_of(name: str, module: LinearBase) -> KernelBlocks:
        return gguf_blocks(float32_modules[name].weight, getattr(module, "quantizable", True))

    return blocks_of


class BlockSink:
    """Where a weight loader copies the blocks of a weight that runs on them (load_weights' sink,
    standing in for the parameter: a loader narrows or slices its rows and copies into them): each
    shard's blocks at its rows, packed once all are in; rows past the last shard are zeros, as the
    padding of a vocabulary or a router. No value of the weight is decoded to a dense tensor."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, tuple(shape)
        self.shards: list[tuple[int, FileRows | FileBlocks]] = []

    def narrow(self, dim: int, start: int, length: int) -> _SinkRows:
        assert dim == 0, "a weight loader places a shard at rows of the parameter"
        return _SinkRows(self, start, length)

    def __getitem__(self, rows: slice) -> _SinkRows:
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "a weight loader places a shard at a run of rows"
        return _SinkRows(self, start, stop - start)

    def copy_(self, blocks: object) -> None:
        self.put(0, blocks)

    def put(self, start: int, blocks: object) -> None:
        if not isinstance(blocks, (FileBlocks, FileRows)):
            raise TypeError(
                f"{self.name} loads from a GGUF file's blocks; its loader gave {type(blocks).__name__}"
            )
        self.shards.append((start, blocks))

    def runs(self) -> list[FileRows | FileBlocks]:
        """The shards in row order, those of one block family (4-bit or 8-bit) joined: one run, or a
        qkv's runs of rows on two families (file_segments). A run of one file type stays the file's
        bytes (FileRows), the others are decoded and joined."""
        shards = sorted(self.shards, key=lambda shard: shard[0])
        loaded = sum(b.shape[0] for _, b in shards)
        if (
            not shards
            or [start for start, _ in shards]
            != list(itertools.accumulate((b.shape[0] for _, b in shards[:-1]), initial=0))
            or loaded > self.shape[0]
        ):
            raise ValueError(f"{self.name}: the loaded shards do not cover its first rows once")
        if loaded < self.shape[0]:  # padding: zero blocks (a zero scale) of the last shard's type
            last = shards[-1][1]
            if not isinstance(last, FileRows):
                raise ValueError(f"{self.name}: padding rows after decoded blocks")
            zeros = torch.zeros(self.shape[0] - loaded, last.raw.shape[1], dtype=torch.uint8)
            shards.append((loaded, FileRows(last.ggml_type, zeros, last.k, last.block)))
        runs: list[list[FileRows | FileBlocks]] = []
        for _, blocks in shards:
            if runs and _family(runs[-1][0].form) == _family(blocks.form):
                runs[-1].append(blocks)
            else:
                runs.append([blocks])
        joined: list[FileRows | FileBlocks] = []
        for run in runs:
            rows = [r for r in run if isinstance(r, FileRows)]
            one: FileRows | FileBlocks | None = join_rows(rows) if len(rows) == len(run) else None
            if one is None:
                one = join([r.blocks() if isinstance(r, FileRows) else r for r in run])
            assert one is not None, "one family joins"
            joined.append(one)
        return joined


class _SinkRows:
    def __init__(self, sink: BlockSink, start: int, length: int) -> None:
        self.sink, self.start, self.shape = sink, start, (length, *sink.shape[1:])

    def copy_(self, blocks: object) -> None:
        self.sink.put(self.start, blocks)


def _has_kernel(ggml_type: int) -> bool:
    """Whether this CPU runs a weight of this block type on its blocks at every row count."""
    form = FORMS.get(ggml_type)
    if form is None or not build.gguf_linear_available():
        return False
    if form == "q4_1":
        return build.q4_available() and build.q4k_available()  # a Q4_1 part joined to a Q4_K one widens
    if form == "q4_k":
        return build.q4k_available() and build.q5k_available()  # Q5_K's q may fit 4 bits or not
    return build.q8_available()


class Packer(LoadHooks):
    """Packs linear layers (LinearBase) by pack_model's rules, each at most once: as soon as its
    weight is loaded (`loaded`: the LoadHooks load_weights calls), so that a dense weight the
    kernels do not read is freed before the next one is read, and the rest at `finish`. With a GGUF
    `file`, a layer whose every part the file holds in blocks this CPU runs at every row count is
    loaded as those blocks alone (`source`, `sink`: BlockSink), its weight a meta tensor from the
    start."""

    def __init__(
        self,
        model: nn.Module,
        quantization: str | None = None,
        blocks_of: Callable[[str, LinearBase], KernelBlocks] | None = None,
        segments_of: Callable[[str, LinearBase], Segments | None] | None = None,
        file: GgufFile | None = None,
    ) -> None:
        assert quantization != "gguf" or blocks_of is not None, "gguf packs the blocks blocks_of finds"
        self.model, self.quantization, self.blocks_of = model, quantization, blocks_of
        self.segments_of = segments_of  # a merged weight's runs of rows on different block kinds
        # parameters that other modules read (a tied LM head's weight is the token embedding)
        self.shared = {
            id(p) for m in model.modules() if not isinstance(m, LinearBase) for p in m.parameters(False)
        }
        # the linear layers each parameter is the weight of, by the parameter's name: no reference to
        # a parameter is kept here, or a dense weight pack() replaces would live until the end
        param_names = {id(p): name for name, p in model.named_parameters()}
        self.owners: dict[str, list[tuple[str, LinearBase]]] = {}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if (
                isinstance(module, LinearBase)
                and isinstance(weight, torch.Tensor)
                and id(weight) in param_names
            ):
                self.owners.setdefault(param_names[id(weight)], []).append((name, module))
        self.done: set[str] = set()
        self.count = 0
        self.as_bf16: list[str] = []
        self.sinks: dict[str, BlockSink] = {}  # by parameter name: the layers loaded as blocks
        self.block_sources: dict[str, BlockTensor] = {}  # the checkpoint tensors read as blocks, by name
        if file is not None and quantization == "gguf":
            self._plan_blocks(model, file)

    def _plan_blocks(self, model: nn.Module, file: GgufFile) -> None:
        mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
        for param_name, owners in self.owners.items():
            if len(owners) != 1:
                continue
            name, module = owners[0]
            weight = module.weight
            if not isinstance(weight, torch.Tensor) or id(weight) in self.shared:
                continue
            if not packing.bf16_packable(weight):
                continue
            prefix, _, leaf = name.rpartition(".")
            merged = [ckpt for ckpt, (param, _) in mapping.items() if param == leaf] or [leaf]
            parts = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in merged]
            found = [file.source(part) for part in parts]
            sources = [s for s in found if s is not None and _has_kernel(s.ggml_type)]
            if len(sources) < len(parts):
                continue
            families = {_family(s.form) for s in sources}
            if not getattr(module, "quantizable", True) and families != {"8-bit"}:
                continue  # an LM head runs 8-bit blocks only (float32 logits)
            if len(families) > 1 and not (getattr(module, "q_size", 0) and getattr(module, "kv_size", 0)):
                continue  # only a qkv runs its parts on two kernels (SplitWeight)
            self.sinks[param_name] = BlockSink(param_name, tuple(weight.shape))
            self.block_sources.update(zip(parts, sources))
            module.weight = _meta_like(weight)

    def source(self, tensor: NamedTensorSource) -> NamedTensorSource:
        """LoadHooks: the file's blocks for a tensor of a layer loaded as blocks."""
        # its narrow gives blocks, not a tensor: the sink takes them
        return self.block_sources.get(tensor.name, tensor)  # type: ignore[return-value]

    def sink(self, param_name: str) -> BlockSink | None:
        """LoadHooks: where the blocks of a layer loaded as blocks go."""
        return self.sinks.get(param_name)

    def loaded(self, param_name: str) -> None:
        """LoadHooks: every shard of parameter `param_name` is loaded: pack the linear layers whose
        weight it is."""
        for name, module in self.owners.get(param_name, []):
            self.pack(name, module, self.sinks.pop(param_name, None))

    def pack(self, name: str, module: LinearBase, sink: BlockSink | None = None) -> None:
        weight = module.weight
        if name in self.done or not isinstance(weight, torch.Tensor):
            return
        self.done.add(name)
        quantizable = getattr(module, "quantizable", True)
        q4 = q5 = q8 = None
        packed: PackedWeight | None = None
        if sink is not None:
            module.linear_method = PackedLinearMethod(self.pack_sink(sink, quantizable))
            self.count += 1
            del sink
            release_freed_memory()  # the file's rows read for it: the heap keep_freed_memory never trims
            return
        if self.quantization == "gguf" and self.blocks_of is not None:
            q4, q5, q8 = self.blocks_of(name, module)
            if quantizable and q4 is None and q5 is None and q8 is None:
                packed = self.split(name, module)
                if packed is None:
                    self.as_bf16.append(name)
        if packed is None:
            packed = pack_weight(weight, self.quantization if quantizable else None, q4, q8, q5)
        module.linear_method = PackedLinearMethod(packed) if packed is not None else UNQUANTIZED
        self.count += packed is not None
        if packed is not None and not reads_dense(packed) and id(weight) not in self.shared:
            # nothing reads the weight as loaded any more: keep its shape, free its bytes (given back
            # to the system at once: the heap keep_freed_memory never trims would hold them)
            module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
            del weight
            release_freed_memory()

    @staticmethod
    def pack_sink(sink: BlockSink, quantizable: bool) -> packing.GgufWeight | packing.SplitWeight:
        runs = sink.runs()
        parts: list[packing.GgufWeight] = []
        for run in runs:
            packed = (
                packing.file_rows_pack(run.ggml_type, run.raw, *run.shape)
                if isinstance(run, FileRows)
                else None
            )
            if packed is not None:
                parts.append(packed)
                continue
            blocks = run.blocks() if isinstance(run, FileRows) else run
            q4, q5, q8 = kernel_blocks(blocks, quantizable)
            if q4 is None and q5 is None and q8 is None:
                raise RuntimeError(
                    f"{sink.name}: {blocks.form} blocks have no kernel here"
                )  # _has_kernel said so
            parts.append(pack_blocks(q4, q8, q5, factors=blocks.factors))
        if len(parts) == 1:
            return parts[0]
        return packing.SplitWeight(tuple(parts), tuple(b.shape[0] for b in runs))

    def split(self, name: str, module: LinearBase) -> packing.SplitWeight | None:
        """The layer's weight as runs of rows on their own blocks (segments_of), or None."""
        segments = self.segments_of(name, module) if self.segments_of is not None else None
        weight = module.weight
        if segments is None or not isinstance(weight, torch.Tensor):
            return None
        parts, start = [], 0
        for n, (q4, q5, q8) in segments:
            part = pack_weight(weight[start : start + n], None, q4, q8, q5)
            if not isinstance(part, packing.GgufWeight):
                return None
            parts.append(part)
            start += n
        return packing.SplitWeight(tuple(parts), tuple(n for n, _ in segments))

    def finish(self) -> int:
        """Packs every layer not packed yet; logs the gguf layers left bf16; returns how many were
        packed in all."""
        if self.sinks:
            raise ValueError(
                f"{len(self.sinks)} weight(s) loaded as blocks never loaded: {', '.join(self.sinks)}"
            )
        for name, module in self.model.named_modules():
            if isinstance(module, LinearBase):
                self.pack(name, module)
        if self.as_bf16:
            logger.info(
                "--quantization gguf: %d linear layers stay bf16 (%s): %s",
                len(self.as_bf16),
                gguf_bf16_reason(),
                ", ".join(self.as_bf16[:4]) + (", ..." if len(self.as_bf16) > 4 else ""),
            )
        return self.count


def _meta_like(weight: torch.Tensor) -> nn.Parameter:
    """A parameter of `weight`'s shape that holds no bytes, with its loader (sharding.py's attributes)."""
    meta = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
    for attr in ("weight_loader", "shard_ids"):
        if hasattr(weight, attr):
            setattr(meta, attr, getattr(weight, attr))
    return meta


def pack_model(
    model: nn.Module,
    quantization: str | None = None,
    blocks_of: Callable[[str, LinearBase], KernelBlocks] | None = None,
) -> int:
    """Packs every linear layer (LinearBase), setting its linear method to a PackedLinearMethod (or
    UNQUANTIZED where pack_weight leaves the weight as loaded; where nothing reads the weight as loaded
    any more, reads_dense, a meta tensor of its shape replaces it), as int8 with w8a8_int8 unless the layer
    says `quantizable = False` (the LM head, as in SGLang and vLLM), or with gguf on the blocks
    `blocks_of` finds for it (read from the file, file_blocks, or recovered from exact values,
    recovered_blocks): Q4_1, Q4_K or Q5_K on the 4-bit kernel, Q8_0, Q5_0, Q4_0 or Q6_K on the 8-bit
    one (the LM head only there). A gguf layer srt has no kernel for here (another type, or no kernel
    for it on this CPU) stays bf16, and the log names how many. Returns how many were packed. Call
    once, after the weights are loaded (or use a Packer while they load)."""
    return Packer(model, quantization, blocks_of).finish()


def loading_packer(
    model: nn.Module,
    *,
    quantization: str | None,
    deterministic: bool,
    gguf_file: Path | None,
    config: dict[str, Any] | None = None,
) -> Packer | None:
    """A Packer to pack each layer while the checkpoint loads, where its layout needs nothing but
    the weight and the file (not gguf recovered from a float32 load); None otherwise. `config`: the
    checkpoint's Hugging Face config (as a dict), with which the file was converted: without it no
    layer is loaded as blocks alone."""
    if quantization == "gguf" and gguf_file is None:
        return None
    set_one_arithmetic(deterministic)
    if quantization != "gguf" or gguf_file is None:
        return Packer(model, quantization)
    file = GgufFile(gguf_file, config)
    return Packer(model, quantization, file_blocks(model, file), file_segments(model, file), file)


def prepare_weights(
    model: nn.Module,
    *,
    quantization: str | None,
    dtype: torch.dtype,
    deterministic: bool,
    load_float32: Callable[[], nn.Module],
    gguf_file: Path | None = None,
    packer: Packer | None = None,
) -> None:
    """Sets one arithmetic for deterministic inference (set_one_arithmetic) and packs the model's
    weights (pack_model; with gguf, the blocks read from `gguf_file`, the GGUF file the checkpoint was
    converted from, else recovered from the checkpoint loaded again through `load_float32`, then
    dropped; or what `packer`, loading_packer's, did not pack while the checkpoint loaded); logs how many
    were packed and, for bf16 and fp16, the paths this CPU's kernels take."""
    started = time.perf_counter()
    if packer is not None:  # packed while loading: the rest now
        packed = packer.finish()
    else:
        set_one_arithmetic(deterministic)
        blocks_of = segments_of = None
        if quantization == "gguf" and gguf_file:
            file = GgufFile(gguf_file)
            blocks_of, segments_of = file_blocks(model, file), file_segments(model, file)
        elif quantization == "gguf":
            blocks_of = recovered_blocks(load_float32())
        packed = Packer(model, quantization, blocks_of, segments_of).finish()
        del blocks_of  # with the float32 model it holds
    fuse_experts(model)  # a mixture of experts: each layer's experts in one kernel call
    if packed:
        weights = [packed_of(m.linear_method) for m in model.modules() if isinstance(m, LinearBase)]
        kinds = (
            (packing.Int8Weight, "int8"),
            (packing.Q4Weight, "Q4_1"),
            (packing.Q4KWeight, "Q4_K"),
            (packing.Q5KWeight, "Q5_K"),
            (packing.Q8Weight, "8-bit (Q8_0, Q5_0, Q4_0 or Q6_K blocks)"),
            (packing.SplitWeight, "split (a qkv whose parts run on two kinds of blocks)"),
        )
        counts = [(sum(isinstance(w, kind) for w in weights), name) for kind, name in kinds]
        quantized = [f"{count} {name}" for count, name in counts if count]
        source = f", blocks read from {gguf_file.name}" if quantization == "gguf" and gguf_file else ""
        logger.info(
            "packed %d weights for the CPU kernels%s (%.1f s after loading)%s",
            packed,
            f", of them {', '.join(quantized)} ({quantization})" if quantization else "",
            time.perf_counter() - started,
            source,
        )
    if dtype in (torch.bfloat16, torch.float16):
        logger.info(build.describe_paths())
