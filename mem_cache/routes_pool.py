"""The experts each token was routed to, kept per KV slot (SGLang's return_routed_experts, with
--enable-return-routed-experts): a token's routes live as long as its K/V, so a prefix-cache hit has
them too. The model's mixture-of-experts layers write them (model_executor/routed_experts.py); the
scheduler reads a finished request's."""

from __future__ import annotations

import base64

import torch


class RoutesPool:
    def __init__(self, num_slots: int, num_layers: int, top_k: int) -> None:
        # -1: a layer without experts (or a slot never written)
        self.buffer = torch.full((num_slots, num_layers, top_k), -1, dtype=torch.int32)

    def write(self, slots: torch.Tensor, layer_id: int, ids: torch.Tensor) -> None:
        self.buffer[slots, layer_id] = ids.to(torch.int32)

    def read(self, slots: torch.Tensor) -> str:
        """base64 of the int32 routes [len(slots), layers, top_k], as SGLang returns them."""
        routes = self.buffer[slots.to(torch.int64)].contiguous()
        return base64.b64encode(routes.numpy().tobytes()).decode("ascii")
