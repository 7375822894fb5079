"""Attention with torch's scaled_dot_product_attention over the paged KV pool, on any device and dtype.

Decode gathers every request's K/V into one padded [bs, L] block and runs a single SDPA call for
the whole batch (no per-request loop). Extend runs fresh prompts of one length as one causal call;
otherwise it loops over requests: each attends over its cached prefix plus its new tokens with a
causal mask shifted by the prefix.

The default backend on the CPU (model_executor/cpu/attention_backend.py) is this one with our
kernels where they apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mem_cache.kv_pool import KVPool
from model_executor.attention.base import AttentionBackend
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a slots tensor of any shape; index_select on the flat slots is several
    times faster than advanced indexing on the CPU (docs/performance.md)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def extend_mask(prefix: int, new: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[new, prefix + new] bool: query j (position prefix + j) sees keys prefix + j - window + 1 ..
    prefix + j (all from 0 without a window); None where that is plain causal attention."""
    narrow = window is not None and window < prefix + new
    if prefix == 0 and not narrow:
        return None
    mask = torch.ones(new, prefix + new, dtype=torch.bool, device=device).tril(diagonal=prefix)
    if narrow:
        assert window is not None
        mask = mask.triu(diagonal=prefix - window + 1)
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    layer: Attention,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA of q [..., heads, L, d] over k/v [..., kv_heads, S, d] with a bool `mask` [L, S] (None:
    causal where `causal`, else every key). With the layer's logit_softcap, as transformers' eager
    Gemma 2 attention: scaled scores capped to cap * tanh(s / cap), masked, softmax in float32."""
    gqa = layer.num_heads != layer.num_kv_heads
    if layer.logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=layer.scaling, enable_gqa=gqa
        )
    if gqa:
        k = k.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=-3)
        v = v.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scaling
    scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    if mask is None and causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.float().softmax(-1).to(q.dtype), v)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.window_req_to_token: torch.Tensor | None = None  # the window layers' table, if any
        # [bs, L] pool slots through req_to_token (and through the window table), padding repeats slot 0
        self._decode_slots: list[torch.Tensor] = []
        self._decode_mask: torch.Tensor | None = None  # [bs, 1, 1, L] bool, None when no padding
        self._decode_seq_lens: torch.Tensor | None = None
        self._window_masks: dict[int, torch.Tensor | None] = {}  # sliding window -> its decode mask

    def use_window_pages(self, req_to_token: torch.Tensor) -> None:
        self.window_req_to_token = req_to_token

    def in_window_pages(self, layer: Attention) -> bool:
        return layer.layer_id in self.kv_pool.window_layers

    def tables(self) -> list[torch.Tensor]:
        """req_to_token, then the window table where there is one: index a list built over them
        with int(in_window_pages(layer))."""
        return [self.req_to_token] + ([] if self.window_req_to_token is None else [self.window_req_to_token])

    def table(self, layer: Attention) -> torch.Tensor:
        """The request table of the layer's slots: the window table for a layer in window pages."""
        return self.tables()[int(self.in_window_pages(layer))]

    def out_loc(self, layer: Attention, batch: ForwardBatch) -> torch.Tensor:
        """The slots the layer writes the batch's new K/V at."""
        if self.in_window_pages(layer):
            assert batch.window_cache_loc is not None
            return batch.window_cache_loc
        return batch.out_cache_loc

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.is_decode:
            return
        self._window_masks = {}
        max_len = max(batch.seq_lens_cpu)
        slots = [table[batch.req_pool_indices, :max_len] for table in self.tables()]
        self._decode_seq_lens = batch.seq_lens
        if min(batch.seq_lens_cpu) == max_len:
            self._decode_slots, self._decode_mask = slots, None
            return
        valid = torch.arange(max_len, device=slots[0].device).unsqueeze(0) < batch.seq_lens.unsqueeze(1)
        # Padding must point at a written slot: the pool is uninitialised memory and NaN * 0 is NaN.
        self._decode_slots = [torch.where(valid, s, s[:, :1]) for s in slots]
        self._decode_mask = valid[:, None, None, :]

    def _decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """The decode mask of a layer attending within `window` (None: every key): each request's
        keys from seq_len - window on, padding masked."""
        assert self._decode_slots and self._decode_seq_lens is not None
        max_len = self._decode_slots[0].shape[1]
        if window is None or window >= max_len:
            return self._decode_mask
        if window not in self._window_masks:
            at = torch.arange(max_len, device=self._decode_slots[0].device).unsqueeze(0)
            lens = self._decode_seq_lens.unsqueeze(1)
            self._window_masks[window] = ((at < lens) & (at >= lens - window))[:, None, None, :]
        return self._window_masks[window]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        n = q.shape[0]
        # q/k/v may be column slices of one qkv tensor: reshape keeps them views where it can.
        q = q.reshape(n, layer.num_heads, layer.head_dim)
        k = k.reshape(n, layer.num_kv_heads, layer.head_dim)
        v = v.reshape(n, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = self.kv_pool.get_kv_buffer(layer.layer_id)
        self.store_kv(k, v, k_cache, v_cache, layer, batch)
        if batch.is_decode:
            return self.decode(q, k_cache, v_cache, layer)
        return self.extend(q, k, v, k_cache, v_cache, layer, batch)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> None:
        """Writes the new tokens' k/v [n, kv_heads, d] at the layer's `out_loc` of its pool."""
        self.kv_pool.set_kv_buffer(layer.layer_id, self.out_loc(layer, batch), k, v)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention
    ) -> torch.Tensor:
        """q [bs, heads, d], one row a request -> [bs, heads*d], over each request's slots."""
        slots = self._decode_slots[int(self.in_window_pages(layer))]
        k_all = gather(k_cache, slots).transpose(1, 2)  # [bs, kv_heads, L, d]
        v_all = gather(v_cache, slots).transpose(1, 2)
        out = attention(q.unsqueeze(2), k_all, v_all, self._decode_mask_for(layer.sliding_window), layer)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [n, heads, d], k/v [n, kv_heads, d] for the new tokens (already in the pool) -> [n, heads*d]:
        each new token over its request's prefix and the new tokens up to itself."""
        n = q.shape[0]
        lens = batch.extend_seq_lens_cpu
        fresh = not any(batch.extend_prefix_lens_cpu)
        window = layer.sliding_window
        if len(lens) > 1 and fresh and min(lens) == max(lens):
            # Fresh prompts of one length (a burst of same-size requests): one causal call for the
            # batch, bit-identical to the loop below and faster (docs/performance.md).
            bs, new = len(lens), lens[0]
            qb = q.reshape(bs, new, layer.num_heads, layer.head_dim).transpose(1, 2)
            kb = k.reshape(bs, new, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
            vb = v.reshape(bs, new, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
            out = attention(qb, kb, vb, extend_mask(0, new, window, q.device), layer, causal=True)
            return out.transpose(1, 2).reshape(n, layer.num_heads * layer.head_dim)
        outputs = []
        start = 0
        for i, (prefix, new) in enumerate(zip(batch.extend_prefix_lens_cpu, lens)):
            qi = q[start : start + new].transpose(0, 1).unsqueeze(0)  # [1, heads, new, d]
            mask = extend_mask(prefix, new, window, q.device)
            if prefix == 0:
                ki = k[start : start + new].transpose(0, 1).unsqueeze(0)
                vi = v[start : start + new].transpose(0, 1).unsqueeze(0)
            else:
                slots = self.table(layer)[batch.req_pool_indices[i], : prefix + new]
                ki = gather(k_cache, slots).transpose(0, 1).unsqueeze(0)
                vi = gather(v_cache, slots).transpose(0, 1).unsqueeze(0)
            oi = attention(qi, ki, vi, mask, layer, causal=True)
            outputs.append(oi.squeeze(0).transpose(0, 1).reshape(new, -1))
            start += new
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
