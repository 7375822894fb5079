"""Attention on our CPU kernels (kernels/), torch SDPA (TorchNativeAttnBackend) where
they do not apply. The default backend on the CPU.

Decode with a bf16 pool is one kernel call per layer: it writes the new K/V and attends straight
from the pool through `req_to_token`, with no gathered copy. Extend writes its K/V rows into the
pool in one parallel kernel call and runs every request in one AMX or AVX-512 BF16 kernel call
where the CPU has either (bf16, head size 64 or 128; cached prefixes gathered from the pool).

With `deterministic` (--enable-deterministic-inference) and the bf16 kernel, extend runs every new
token as a decode row of that same kernel: the token attends over its own slots with the arithmetic
a decode step would use for it (the kernel splits a row's keys by the row's length only, never by
the batch), so a token's K/V and output have the same bits whether it was prefilled, in any chunk
or behind any cached prefix, or decoded.
"""

from __future__ import annotations

import torch

from mem_cache.kv_pool import KVPool
from model_executor.attention.torch_native import TorchNativeAttnBackend, gather
from model_executor.cpu.kernels import ops
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import Attention


class CpuKernelsAttnBackend(TorchNativeAttnBackend):
    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor, deterministic: bool = False) -> None:
        super().__init__(kv_pool, req_to_token)
        self._extend_slots: list[torch.Tensor] = []  # extend with cached prefixes: each request's
        # prefix + new slots, one after another, through req_to_token (and the window table)
        self._rows: tuple[torch.Tensor, torch.Tensor, int] | None = None  # deterministic extend: each new
        # token's (req_to_token row, length with its own slot, longest)
        k_cache, _ = kv_pool.get_kv_buffer(0)
        self.kernel_attention = (
            ops.usable(k_cache)
            and k_cache.is_contiguous()
            and req_to_token.is_contiguous()
            and req_to_token.dtype == torch.int64
        )
        # Extend on the decode kernel: only the kernel path has one arithmetic for both phases.
        self.decode_rows_extend = deterministic and self.kernel_attention

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.is_decode and self.decode_rows_extend:
            lens = torch.tensor(batch.extend_seq_lens_cpu)
            own = torch.cat(
                [
                    torch.arange(prefix + 1, prefix + new + 1)
                    for prefix, new in zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)
                ]
            )
            self._rows = (
                batch.req_pool_indices.repeat_interleave(lens.to(batch.req_pool_indices.device)),
                own.to(batch.seq_lens.device),
                max(batch.seq_lens_cpu),
            )
            return
        if not batch.is_decode:
            prefixes = batch.extend_prefix_lens_cpu
            self._extend_slots = (
                [
                    torch.cat(
                        [
                            table[batch.req_pool_indices[i], : prefix + new]
                            for i, (prefix, new) in enumerate(zip(prefixes, batch.extend_seq_lens_cpu))
                        ]
                    )
                    for table in self.tables()
                ]
                if any(prefixes)
                else []
            )
            return
        if self.kernel_attention:
            return
        super().init_forward_metadata(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        if self.kernel_attention and (batch.is_decode or self.decode_rows_extend) and ops.usable(q, k, v):
            # A decode step's rows are its requests; a deterministic extend's, its new tokens.
            if batch.is_decode:
                rows, row_lens, max_len = batch.req_pool_indices, batch.seq_lens, max(batch.seq_lens_cpu)
            else:
                assert self._rows is not None
                rows, row_lens, max_len = self._rows
            k_cache, v_cache = self.kv_pool.get_kv_buffer(layer.layer_id)
            return ops.decode_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                self.out_loc(layer, batch),
                self.table(layer),
                rows,
                row_lens,
                max_len,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                layer.scaling,
                window=layer.sliding_window,
                softcap=layer.logit_softcap,
            )
        return super().forward(q, k, v, layer, batch)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> None:
        out_loc = self.out_loc(layer, batch)
        if ops.store_kv_applies(k, v, k_cache, v_cache, out_loc):
            ops.store_kv(k, v, k_cache, v_cache, out_loc)  # faster than index_copy_ (docs/performance.md)
        else:
            super().store_kv(k, v, k_cache, v_cache, layer, batch)

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
        window = layer.sliding_window
        if (
            not ops.prefill_attention_applies(q, layer.num_heads, layer.num_kv_heads, layer.head_dim)
            or (window is not None and window < max(batch.seq_lens_cpu))
            or layer.logit_softcap
        ):  # the prefill kernel attends causally over every key, uncapped: else the torch path
            return super().extend(q, k, v, k_cache, v_cache, layer, batch)
        # bf16 on AMX: every request in one kernel call (faster than SDPA for fresh prompts and than
        # the masked SDPA for a chunk after cached tokens: docs/performance.md). With cached
        # prefixes the keys are each request's slots in the pool, the new tokens' just written.
        lens, prefixes = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        if not any(prefixes):
            return ops.prefill_attention(q, k, v, lens, layer.scaling)
        assert self._extend_slots
        extend_slots = self._extend_slots[int(self.in_window_pages(layer))]
        return ops.prefill_attention(
            q, gather(k_cache, extend_slots), gather(v_cache, extend_slots), lens, layer.scaling, prefixes
        )
