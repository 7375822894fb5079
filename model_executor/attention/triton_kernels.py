"""Triton kernels for attention over the paged KV pool: split-KV decode and causal extend.

Both read K/V straight from the pool through `req_to_token` (slot = page * page_size + offset),
so pages need not be contiguous. Scores, softmax and the output accumulate in float32 whatever
the q/k/v dtype. head_dim may be any size up to 256: the kernels work on BLOCK_D = its next
power of two and mask the rest.

Decode splits each request's keys into NUM_SPLITS equal ranges, one program each, so a small
batch still fills the GPU; a second kernel merges the partial outputs by their log-sum-exp:

    keys   |---- split 0 ----|---- split 1 ----| ... |-- split S-1 --|
    split s: o_s = softmax-weighted V over its range, lse_s = log(sum(exp(scores)))
    merge:   out = sum_s exp(lse_s - max lse) * o_s / sum_s exp(lse_s - max lse)

An empty split (a sequence shorter than NUM_SPLITS) stores lse = -inf and weighs nothing. With
grouped-query attention one program serves the query heads of a KV head (each key block read once
for all of them, the products as tl.dot); with one query head per KV head, one program a head.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 256

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def block_d(head_dim: int) -> int:
    # tl.dot needs every side >= 16
    return max(16, triton.next_power_of_2(head_dim))


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype tl.dot multiplies q's in: q's own, except bfloat16 under the interpreter, whose
    tl.dot multiplies bfloat16 as its raw bits (float32 there)."""
    dot_dtype = _TL_DTYPES.get(dtype)
    if dot_dtype is None:
        raise ValueError(f"q dtype must be one of {list(_TL_DTYPES)} for the triton backend, got {dtype}")
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return dot_dtype


def _dot_precision(dot_dtype: tl.dtype) -> str:
    # float32 inputs: true float32 products, not tf32, so the result matches a float32 reference
    return "ieee" if dot_dtype == tl.float32 else "tf32"


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}] for the triton backend, got {head_dim}")


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    Q,
    K_cache,
    V_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    Mid_O,
    Mid_LSE,
    sm_scale,
    stride_q_b,
    stride_q_h,
    stride_k_slot,
    stride_k_h,
    stride_v_slot,
    stride_v_h,
    stride_r2t,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_lse_b,
    stride_lse_h,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_h = h // KV_GROUP
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_q_b + h * stride_q_h + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    m = -float("inf")
    l_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_cache + slots[:, None] * stride_k_slot + kv_h * stride_k_h + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(tl.float32)
        scores = tl.sum(q[None, :] * k, axis=1) * sm_scale
        scores = tl.where(mask_n, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(
            V_cache + slots[:, None] * stride_v_slot + kv_h * stride_v_h + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        m = m_new

    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l_sum, 1.0)), -float("inf"))
    tl.store(Mid_O + b * stride_mo_b + h * stride_mo_h + split * stride_mo_s + offs_d, out, mask=mask_d)
    tl.store(Mid_LSE + b * stride_lse_b + h * stride_lse_h + split, lse)


@triton.jit
def _decode_grouped_split_kernel(  # type: ignore[no-untyped-def]
    Q,
    K_cache,
    V_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    Mid_O,
    Mid_LSE,
    sm_scale,
    stride_q_b,
    stride_q_h,
    stride_k_slot,
    stride_k_h,
    stride_v_slot,
    stride_v_h,
    stride_r2t,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_lse_b,
    stride_lse_h,
    KV_GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """_decode_split_kernel for the KV_GROUP query heads that share one KV head, in one program
    (grid: request, KV head, split): each key and value block is read once for the group, and the
    products are two tl.dot over the group's rows (BLOCK_H >= 16, the rows past KV_GROUP masked)."""
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < KV_GROUP
    heads = kv_h * KV_GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_cache + slots[:, None] * stride_k_slot + kv_h * stride_k_h + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_H, BLOCK_N]
        scores = tl.where(mask_n[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # the block's first key is in range: finite
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(
            V_cache + slots[:, None] * stride_v_slot + kv_h * stride_v_h + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new

    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l_sum, 1.0)), -float("inf"))
    tl.store(
        Mid_O + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :],
        out,
        mask=mask_g[:, None] & mask_d[None, :],
    )
    tl.store(Mid_LSE + b * stride_lse_b + heads * stride_lse_h + split, lse, mask=mask_g)


@triton.jit
def _decode_merge_kernel(  # type: ignore[no-untyped-def]
    Mid_O,
    Mid_LSE,
    Out,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_lse_b,
    stride_lse_h,
    stride_o_b,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(Mid_LSE + b * stride_lse_b + h * stride_lse_h + offs_s)
    weight = tl.exp(lse - tl.max(lse, axis=0))  # split 0 is never empty, so the max is finite
    o = tl.load(
        Mid_O + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * o, axis=0) / tl.sum(weight, axis=0)
    tl.store(Out + b * stride_o_b + h * stride_o_h + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]
    Q,
    K_cache,
    V_cache,
    Out,
    req_to_token,
    req_pool_indices,
    qo_indptr,
    prefix_lens,
    extend_lens,
    sm_scale,
    stride_q_t,
    stride_q_h,
    stride_k_slot,
    stride_k_h,
    stride_v_slot,
    stride_v_h,
    stride_r2t,
    stride_o_t,
    stride_o_h,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_h = h // KV_GROUP
    extend_len = tl.load(extend_lens + b).to(tl.int32)
    if m_block * BLOCK_M >= extend_len:
        return
    q_start = tl.load(qo_indptr + b).to(tl.int64)
    prefix_len = tl.load(prefix_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)

    # New token i of the request sits at position prefix_len + i and sees keys 0 .. prefix_len + i;
    # its k/v are already in the pool, so every key is read through req_to_token.
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    query_pos = prefix_len + offs_m
    kv_end = tl.minimum(prefix_len + extend_len, prefix_len + (m_block + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_cache + slots[:, None] * stride_k_slot + kv_h * stride_k_h + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(DOT_DTYPE)  # a pool of another dtype (float8) meets q in q's
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        visible = mask_n[None, :] & (offs_n[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, -float("inf"))
        # every row sees key 0 in the first block, so m_new is finite from then on
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(
            V_cache + slots[:, None] * stride_v_slot + kv_h * stride_v_h + offs_d[None, :],
            mask=mask_kv,
            other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_o_t + h * stride_o_h + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
) -> None:
    """Writes out [bs, heads, d] = attention of q [bs, heads, d] (one token a request) over the
    slots req_to_token[req_pool_indices[b], :seq_lens[b]] of k_cache/v_cache [slots, kv_heads, d].

    mid_o [>= bs, heads, splits, d] and mid_lse [>= bs, heads, splits] (float32) are scratch; the
    number of splits is their size (a power of two). Reads only device tensors: the grid depends
    on shapes alone, so a CUDA graph captured over it replays for any seq_lens.
    """
    bs, num_heads, head_dim = q.shape
    num_splits = mid_lse.shape[2]
    num_kv_heads = k_cache.shape[1]
    kv_group = num_heads // num_kv_heads
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), NUM_SPLITS=num_splits)
    args = (
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
    )
    if kv_group > 1:  # grouped query attention: each KV head's keys read once for its query heads
        dot_dtype = _dot_dtype(q.dtype)
        _decode_grouped_split_kernel[(bs, num_kv_heads, num_splits)](
            *args,
            KV_GROUP=kv_group,
            BLOCK_H=max(16, triton.next_power_of_2(kv_group)),
            BLOCK_N=32,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=_dot_precision(dot_dtype),
            **common,
        )
    else:
        _decode_split_kernel[(bs, num_heads, num_splits)](*args, KV_GROUP=1, BLOCK_N=64, **common)
    _decode_merge_kernel[(bs, num_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        **common,
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
) -> None:
    """Writes out [n, heads, d] for the new tokens q [n, heads, d]: request b's rows
    qo_indptr[b] .. qo_indptr[b] + extend_lens[b] attend over its prefix_lens[b] cached tokens and,
    causally, its new tokens, all read from the pool through req_to_token (the new k/v must
    already be written there)."""
    bs = req_pool_indices.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    bd = block_d(head_dim)
    dot_dtype = _dot_dtype(q.dtype)
    # keeps q, k, v and the [M, D] accumulator of one program in shared memory at head_dim 256
    block = 64 if bd * q.element_size() <= 256 else 32
    _extend_kernel[(bs, num_heads, triton.cdiv(max_extend_len, block))](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_pool_indices,
        qo_indptr,
        prefix_lens,
        extend_lens,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        out.stride(0),
        out.stride(1),
        KV_GROUP=num_heads // k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=bd,
        BLOCK_M=block,
        BLOCK_N=block,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=_dot_precision(dot_dtype),
    )
