"""A decode step's decoder layers on one rank as one srt_decode_layer call each, every layer's
weight and KV-cache pointers gathered once (DecodeLayers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from model_executor.cpu.kernels import ops
from model_executor.cpu.kernels.build import kernels
from model_executor.cpu.kernels.ops import GEMV_MAX_ROWS
from model_executor.cpu.kernels.ops import data_ptr as _p
from model_executor.cpu.kernels.packing import GgufWeight, Int8Weight, Q8Weight, SplitWeight

# A GGUF weight (GgufWeight): its blocks (and a bf16 copy for more rows than their kernel takes, where
# no srt_gguf_linear); a qkv's SplitWeight: q and k on one kind of blocks, v on another
KernelWeight = torch.Tensor | Int8Weight | GgufWeight | SplitWeight


TILES = 8  # a kind's flag: srt_gguf_linear, widening its blocks to bf16 a task at a time


def gguf_kind(weight: GgufWeight) -> int:
    """srt_decode_layer's kind of the weight's blocks (cpu_kernels.c's KIND_*), by their size."""
    return ops.GGUF_KINDS[weight.packed.shape[-1]]


def gguf_max_rows(weight: GgufWeight) -> int:
    """The most rows the kernel of the weight's blocks takes."""
    return ops.q8_max_rows(weight.packed) if isinstance(weight, Q8Weight) else ops.q4_max_rows(weight.packed)


@dataclass
class DecodeLayerWeights:
    """What srt_decode_layer needs of one decoder layer that does not change between steps."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    w_gate_up: torch.Tensor | None  # None: a mixture of experts (moe)
    w_down: torch.Tensor | None
    packed: Sequence[KernelWeight | None] | None  # qkv, o, gate_up, down packed by bf16_pack,
    # int8_pack or a GGUF weight's blocks (gate_up and down None with moe; qkv a SplitWeight at v's
    # rows), or None (gemv)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_norm: torch.Tensor | None = None  # Qwen3's per-head RMSNorm weights (with the layer's eps)
    k_norm: torch.Tensor | None = None
    moe: torch.Tensor | None = None  # srt_moe_block's descriptor (cpu/moe.py's FusedExperts)
    moe_top_k: int = 0
    on_route: Callable[[torch.Tensor], None] | None = None  # called with each step's expert ids [m, top_k]
    sliding_window: int | None = None  # the layer's attention window (Attention.sliding_window)
    window_pages: bool = (
        False  # its K/V in window pages: slots through the window table (mem_cache/window_pages.py)
    )
    # with LoRA on: the linear methods of qkv, o, gate_up and down (lora/linear_method.py's
    # LoraLinearMethod: its `table` for srt_lora_delta, its `batch.row_slots` for the step; None for
    # a mixture's MLP), else None
    lora: Sequence[Any | None] | None = None


class DecodeLayers:
    """Every decoder layer of a decode step on one rank (TP=1), one srt_decode_layer call each.

    The weights, norms and KV buffers never move, so their pointers are gathered once here: per
    step only the batch's own arguments are converted (Python glue around 30 per-layer calls was
    a measurable share of a step before: docs/performance.md). With packed weights (`packed`) any number
    of rows, else at most GEMV_MAX_ROWS; a GGUF weight on its blocks up to the rows its kernel takes
    (gguf_max_rows), above that through srt_gguf_linear (TILES) or on its bf16 copy. Every tensor contiguous bf16 /
    int64."""

    def __init__(self, layers: Sequence[DecodeLayerWeights]) -> None:
        self.layers = list(layers)  # keeps the tensors behind the pointers alive
        first = self.layers[0]
        self.packed = all(w.packed is not None for w in self.layers)
        self.hidden_size = first.w_o.shape[0]
        intermediate = max((w.w_down.shape[1] for w in self.layers if w.w_down is not None), default=0)
        self.sizes = (first.w_qkv.shape[0], first.w_o.shape[1], intermediate)  # qkv, q, intermediate
        gguf = [t for w in self.layers for t in self._slots(w) if isinstance(t, GgufWeight)]
        # the most rows of a step with some weight on its GGUF blocks
        self.block_rows = max(map(gguf_max_rows, gguf), default=0) if self.packed else 0
        self._args: dict[int, list[tuple[tuple, tuple, tuple, tuple]]] = {}  # by rows (0: the bf16 copies)
        # the tables, and each layer's array (None without LoRA)
        self._lora: tuple[list[Any], list[torch.Tensor | None]] = ([], [None] * len(self.layers))

    def lora_tables_taken(self) -> bool:
        """Whether the kernel takes every adapter on every layer (a table for each method with one)."""
        return all(
            m is None or m.table is not None or not m.adapters for w in self.layers for m in w.lora or ()
        )

    def _lora_args(self) -> list[torch.Tensor | None]:
        """Each layer's `lora` array for srt_decode_layer (table address and slots of qkv, o, gate_up
        and down), made again when some layer's tables changed (an adapter loaded or unloaded); the
        tables are held here, so that their addresses stay theirs."""
        tables = [None if m is None else m.table for w in self.layers for m in w.lora or ()]
        if len(tables) != len(self._lora[0]) or any(a is not b for a, b in zip(tables, self._lora[0])):
            arrays: list[torch.Tensor | None] = []
            for w in self.layers:
                words = []
                for m in w.lora or ():
                    table = None if m is None else m.table
                    words += [0, 0] if table is None else [table.data_ptr(), table.shape[0]]
                arrays.append(torch.tensor(words, dtype=torch.int64) if w.lora is not None else None)
            self._lora = (tables, arrays)
        return self._lora[1]

    @property
    def q4(self) -> bool:
        """Whether some weight runs on its GGUF blocks at one row."""
        return self.block_rows >= 1

    def layer_args(self, m: int) -> list[tuple[tuple, tuple, tuple, tuple]]:
        """Every layer's arguments for a step of m rows, gathered at the first step of that many
        (each GGUF weight on its blocks where its kernel takes m rows)."""
        key = m if m <= self.block_rows else 0
        if key not in self._args:
            self._args[key] = [self._layer_args(w, key) for w in self.layers]
        return self._args[key]

    @staticmethod
    def _slots(w: DecodeLayerWeights) -> list[KernelWeight | None]:
        """srt_decode_layer's weights: qkv (or a split qkv's q and k), o, gate_up, down, a split
        qkv's v (else None)."""
        slots = list(w.packed) if w.packed is not None else [None] * 4
        qkv = slots[0]
        if isinstance(qkv, SplitWeight):
            return [qkv.parts[0], *slots[1:], qkv.parts[1]]
        return [*slots, None]

    def _layer_args(self, w: DecodeLayerWeights, rows: int) -> tuple[tuple, tuple, tuple, tuple]:
        """rows: the step's (0: more than any GGUF weight's kernel takes)."""

        kernel_weights = self._slots(w)

        def blocks(i: int) -> GgufWeight | None:
            """The i-th weight where it runs on its blocks' kernel at this many rows."""
            t = kernel_weights[i]
            return t if isinstance(t, GgufWeight) and 0 < rows <= gguf_max_rows(t) else None

        def tiles(i: int) -> GgufWeight | None:
            """The i-th weight where it runs on its blocks through srt_gguf_linear (no bf16 copy)."""
            t = kernel_weights[i]
            return t if isinstance(t, GgufWeight) and t.bf16 is None and blocks(i) is None else None

        def pointer(i: int) -> int | None:
            t = kernel_weights[i]
            if isinstance(t, GgufWeight):
                return (t.bf16 if blocks(i) is None and t.bf16 is not None else t.packed).data_ptr()
            if t is None:
                return None
            assert not isinstance(t, SplitWeight), "_slots gives a split qkv's parts"
            return t.packed.data_ptr() if isinstance(t, Int8Weight) else t.data_ptr()

        scales = [t.scale.data_ptr() if isinstance(t, Int8Weight) else None for t in kernel_weights[:4]]
        kinds = sum(gguf_kind(t) << (4 * i) for i in range(5) if (t := blocks(i)) is not None)
        kinds += sum((gguf_kind(t) | TILES) << (4 * i) for i in range(5) if (t := tiles(i)) is not None)
        weights = (
            w.ln1.data_ptr(),
            w.ln2.data_ptr(),
            w.eps,
            w.w_qkv.data_ptr(),
            _p(w.b_qkv),
            w.w_o.data_ptr(),
            _p(w.w_gate_up),
            _p(w.w_down),
            *map(pointer, range(4)),
            pointer(4),
            *scales,
            kinds,
        )
        intermediate = 0 if w.w_down is None else w.w_down.shape[1]
        dims = (
            self.hidden_size,
            w.num_heads,
            w.num_kv_heads,
            w.head_dim,
            intermediate,
            w.scale,
            w.sliding_window or 0,
        )
        return (
            weights,
            (w.k_cache.data_ptr(), w.v_cache.data_ptr()),
            dims,
            (_p(w.q_norm), _p(w.k_norm), _p(w.moe)),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        window: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after every layer, as the op-by-op layers would return them (hidden
        float32 where the down products store float32 sums, else bf16; the residual float32).
        `window`: (out_loc, req_to_token) in window slots, for the layers in window pages."""
        lib = kernels()
        m = hidden.shape[0]
        assert lib is not None and (self.packed or m <= GEMV_MAX_ROWS) and hidden.is_contiguous()
        qkv_size, q_size, intermediate = self.sizes

        def buf(n: int) -> torch.Tensor:
            return torch.empty(m, n, dtype=torch.bfloat16)

        residual = torch.empty(m, self.hidden_size, dtype=torch.float32)  # the stream (RMSNorm)
        out = buf(self.hidden_size)
        out_f32 = torch.empty(m, self.hidden_size, dtype=torch.float32)  # o / down sums, unrounded
        scratch = [
            buf(qkv_size),
            buf(q_size),
            buf(self.hidden_size),
            buf(2 * intermediate),
            buf(intermediate),
            out,
        ]
        step = (positions.data_ptr(), cos.data_ptr(), sin.data_ptr())
        tail = (rows.data_ptr(), seq_lens.data_ptr(), max_len, m)
        batches = [(out_loc.data_ptr(), req_to_token.data_ptr(), req_to_token.stride(0), *tail)]
        if window is not None:
            batches.append((window[0].data_ptr(), window[1].data_ptr(), window[1].stride(0), *tail))
        scratch_ptrs = [t.data_ptr() for t in scratch] + [out_f32.data_ptr()]
        hidden_ptr, hidden_f32, residual_ptr = hidden.data_ptr(), 0, residual.data_ptr()
        # each MoE layer's chosen experts, for its on_route once the step is done
        routes = [
            torch.empty(m, w.moe_top_k, dtype=torch.int64) if w.moe is not None else None for w in self.layers
        ]
        lora = self._lora_args()
        qkv_lora = self.layers[0].lora[0] if self.layers[0].lora is not None else None
        row_slots = None if qkv_lora is None else qkv_lora.batch.row_slots
        for i, (weights, kv, dims, extras) in enumerate(self.layer_args(m)):
            hidden_f32 = lib.srt_decode_layer(
                hidden_ptr,
                hidden_f32,
                residual_ptr,
                int(i == 0),
                *weights,
                *step,
                *kv,
                *batches[int(self.layers[i].window_pages)],
                *dims,
                *extras,
                _p(routes[i]),
                _p(row_slots),
                _p(lora[i]),
                *scratch_ptrs,
            )
            # each layer's MLP output (out_f32 where the down product stored its sums) is the next one's input
            hidden_ptr = scratch_ptrs[-1] if hidden_f32 else scratch_ptrs[-2]
        for w, ids in zip(self.layers, routes):
            if w.on_route is not None and ids is not None:
                w.on_route(ids)
        return (out_f32 if hidden_f32 else out), residual
