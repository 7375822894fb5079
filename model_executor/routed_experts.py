"""SGLang's return_routed_experts on the model side: every mixture-of-experts layer writes the
experts it chose for each token of a step into the KV memory's RoutesPool (mem_cache/routes_pool.py),
at the step's KV slots.

Every rank routes every token alike (layers/moe.py), so the output rank's pool is every rank's. The
scheduler reads a finished request's routes: the tokens fed through the model from
routed_experts_start_len on (every prompt token and every output token but the last)."""

from __future__ import annotations

import torch
from torch import nn

from mem_cache.routes_pool import RoutesPool
from model_executor.layers.moe import SparseMoeBlock


class RouteCapture:
    def __init__(
        self, model: nn.Module, blocks: list[SparseMoeBlock], num_slots: int, num_layers: int
    ) -> None:
        """`blocks`: the model's MoE layers on this rank."""
        if not blocks:
            raise ValueError(
                f"--enable-return-routed-experts: {type(model).__name__} has no mixture-of-experts layers"
            )
        self.pool = RoutesPool(num_slots, num_layers, blocks[0].top_k)
        self._slots: torch.Tensor | None = None
        for block in blocks:
            block.route_hook = self._capture

    def begin(self, out_cache_loc: torch.Tensor) -> None:
        """The KV slots of the step's new tokens, in the order the layers see them."""
        self._slots = out_cache_loc

    def _capture(self, layer_id: int, ids: torch.Tensor) -> None:
        assert self._slots is not None and self._slots.shape[0] == ids.shape[0]
        self.pool.write(self._slots, layer_id, ids)
