"""LoraAdapters: one rank's LoRA adapters, attached to its model's linear layers.

Made by the ModelRunner after the device's wing has laid out the weights: every adaptable linear
layer (attention and dense MLP projections; not the LM head, the router or a mixture's experts)
gets a LoraLinearMethod (model_executor/lora/linear_method.py) around its method, and each adapter
of `--lora-paths` is read from its peft folder and sharded into the layers it targets. An
adapter's B goes through the model's own checkpoint mapping (load_weights.param_parts) and its
layer's weight loader, so its rows land where the weight's rows do: q/k/v and gate/up into the
merged layers, a checkpoint's fused qkv split, q's and k's rows in srt's rotary order, TP shards.
Before each forward `begin` tells the layers which rows are whose.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from model_executor.layers.moe import SparseMoeBlock
from model_executor.loader.load_weights import param_parts
from model_executor.loader.weight_source import LazyTensor
from model_executor.lora.linear_method import LayerLora, LoraBatch, LoraLinearMethod, LoraPart
from srt.lora_config import WEIGHTS_FILE, LoraRef, read_adapter_config

logger = logging.getLogger("srt.lora")

# peft's names: base_model.model.<module>.lora_A.weight (an adapter name after lora_A in memory only)
_TENSOR = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")


class LoraAdapters:
    def __init__(
        self,
        model: nn.Module,
        adapters: tuple[LoraRef, ...],
        device: torch.device,
        max_rank: int | None = None,
        row_by_row: bool = False,
    ) -> None:
        """Wraps `model`'s adaptable layers and loads `adapters` as ids 1, 2, ... onto `device`
        (`row_by_row`: deterministic inference, LoraBatch); ValueError naming the adapter and the
        module for one that does not fit the model."""
        self.model = model
        self.device = device
        self.batch = LoraBatch(row_by_row=row_by_row)
        self.methods: dict[str, LoraLinearMethod] = {}
        experts = {
            id(m) for block in model.modules() if isinstance(block, SparseMoeBlock) for m in block.modules()
        }
        self.experts = {name for name, m in model.named_modules() if id(m) in experts}
        for name, module in model.named_modules():
            if type(module) in _ADAPTABLE and name not in self.experts:
                assert isinstance(module, LinearBase)
                method = LoraLinearMethod(module.linear_method, self.batch)
                module.linear_method = method
                self.methods[name] = method
        self.max_rank = max_rank
        self.names: dict[str, int] = {}
        self.slots: dict[int, int] = {}  # adapter id -> its slot in every layer (the smallest free)
        for adapter_id, ref in enumerate(adapters, start=1):
            self.load(adapter_id, ref)

    def load(self, adapter_id: int, ref: LoraRef) -> None:
        """Reads `ref`'s folder and attaches this rank's shard of it as `adapter_id`: every layer at
        once, after every check passed (ValueError naming the adapter and the cause, or OSError for
        a folder that cannot be read, leaves the layers as they were)."""
        config = read_adapter_config(ref.path, self.max_rank)
        where = f"LoRA adapter {ref.name!r}"
        modules: dict[str, dict[str, torch.Tensor]] = {}
        try:
            tensors = load_file(Path(ref.path) / WEIGHTS_FILE)
        except Exception as error:  # safetensors' own error type, or the OS's
            raise ValueError(f"{where}: {WEIGHTS_FILE} could not be read: {error}") from None
        for key, tensor in sorted(tensors.items()):
            match = _TENSOR.fullmatch(key)
            if match is None:
                raise ValueError(
                    f"{where}: tensor {key} is not a linear layer's lora_A or lora_B (not implemented)"
                )
            modules.setdefault(match["module"], {})[match["ab"]] = tensor.float()
        layers: dict[str, list[tuple[torch.Tensor, slice, torch.Tensor]]] = {}
        for module, pair in modules.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{where}: module {module} has lora_{''.join(pair)} alone")
            a, b = pair["A"], pair["B"] * config.scaling
            if a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"{where}: module {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} differ in rank"
                )
            for name, piece in self._shard(where, module, a, b).items():
                layers.setdefault(name, []).append(piece)
        nbytes = 0
        slot = min(set(range(len(self.slots) + 1)) - set(self.slots.values()))
        for name, pieces in layers.items():
            pieces.sort(key=lambda p: p[1].start)  # the layer's output order: q, k, v; gate, up
            parts, start = [], 0
            for a, outputs, b in pieces:
                parts.append(LoraPart(slice(start, start + a.shape[0]), outputs, b.T.contiguous()))
                start += a.shape[0]
            lora = LayerLora(torch.cat([a for a, _, _ in pieces]), tuple(parts))
            self.methods[name].attach(slot, lora)
            nbytes += lora.nbytes
        self.names[ref.name] = adapter_id
        self.slots[adapter_id] = slot
        logger.info(
            "LoRA adapter %r (id %d, rank %d): %d layers, %.1f MB on this rank",
            ref.name,
            adapter_id,
            config.rank,
            len(layers),
            nbytes / 2**20,
        )

    def unload(self, adapter_id: int) -> None:
        """Drops adapter `adapter_id` from every layer (a no-op for an id never loaded)."""
        slot = self.slots.pop(adapter_id, None)
        if slot is None:
            return
        for method in self.methods.values():
            if slot in method.adapters:
                method.attach(slot, None)
        self.names = {name: i for name, i in self.names.items() if i != adapter_id}

    def _shard(
        self, where: str, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, slice, torch.Tensor]]:
        """This rank's (A, output columns, B) of one adapted checkpoint module, by the layer it goes
        into; empty where the module is another pipeline stage's."""
        out: dict[str, tuple[torch.Tensor, slice, torch.Tensor]] = {}
        # a column-parallel layer's B, filled by its weight loader (with a checkpoint's fused module,
        # Phi-3's qkv_proj, one A and B's parts side by side), and the output rows filled
        columns: dict[str, tuple[torch.Tensor, slice]] = {}
        for part, target, shard_id in param_parts(self.model, LazyTensor.from_tensor(f"{module}.weight", b)):
            name = target.removesuffix(".weight")
            if name not in self.methods:
                what = (
                    "a mixture's experts (MoE experts are not implemented)"
                    if name in self.experts
                    else ("no linear layer srt adapts")
                )
                raise ValueError(f"{where}: target module {module} is {what} in the base model")
            layer = self.model.get_submodule(name)
            if isinstance(layer, RowParallelLinear):
                size, tp = layer.input_size_per_rank, layer.comm.world_size
                if a.shape[1] != size * tp:
                    raise ValueError(
                        f"{where}: {module}'s lora_A has {a.shape[1]} inputs, the layer {size * tp}"
                    )
                a_local = a.narrow(1, layer.comm.rank_in_group * size, size)
                out[name] = (a_local.to(self.device), slice(0, b.shape[0]), b.to(self.device))
                continue
            assert isinstance(layer, ColumnParallelLinear)
            if a.shape[1] != layer.input_size:
                raise ValueError(
                    f"{where}: {module}'s lora_A has {a.shape[1]} inputs, the layer {layer.input_size}"
                )
            buffer, rows = columns.get(name, (torch.zeros(layer.output_size_per_rank, b.shape[1]), None))
            try:
                layer.weight_loader(buffer, part, shard_id)
            except (ValueError, RuntimeError) as error:
                raise ValueError(
                    f"{where}: {module}'s lora_B {tuple(b.shape)} does not fit the layer: {error}"
                ) from None
            more = _output_rows(layer, shard_id)
            rows = more if rows is None else slice(min(rows.start, more.start), max(rows.stop, more.stop))
            columns[name] = (buffer, rows)
        for name, (buffer, rows) in columns.items():
            out[name] = (a.to(self.device), rows, buffer[rows].to(self.device))
        return out

    def begin(self, batch: ForwardBatch) -> None:
        """Tells the layers which of this step's token rows run under which adapter's slot."""
        ids = batch.lora_ids
        if not ids or not any(ids):
            self.batch.start(None)
            return
        per_request = torch.tensor([self.slots.get(i, -1) if i else -1 for i in ids], dtype=torch.int32)
        lens = torch.tensor(batch.extend_seq_lens_cpu)
        self.batch.start(torch.repeat_interleave(per_request, lens).to(batch.input_ids.device))


# the layers an adapter may target (a subclass of one, as the MoE's ReplicatedLinear, is not)
_ADAPTABLE = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)


def _output_rows(layer: ColumnParallelLinear, shard_id: object) -> slice:
    """The rows of this rank's output that a checkpoint module's shard `shard_id` loads into."""
    if isinstance(layer, QKVParallelLinear) and shard_id in ("q", "k", "v"):
        start = {"q": 0, "k": layer.q_size, "v": layer.q_size + layer.kv_size}[shard_id]
        return slice(start, start + (layer.q_size if shard_id == "q" else layer.kv_size))
    if isinstance(layer, MergedColumnParallelLinear) and isinstance(shard_id, int):
        tp = layer.comm.world_size
        start = sum(layer.output_sizes[:shard_id]) // tp
        return slice(start, start + layer.output_sizes[shard_id] // tp)
    return slice(0, layer.output_size_per_rank)
