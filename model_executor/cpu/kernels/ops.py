"""The CPU kernels as functions of tensors: each checks what the C side cannot (dtypes, contiguity,
sizes), allocates the output and passes data pointers through ctypes (build.kernels()).

A bad argument raises ValueError naming it; calling an op where the kernels are not loaded raises
RuntimeError (callers check `usable` or the `*_applies` / `build.*_available` probes first).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Sequence

import torch

from model_executor.cpu.kernels import build
from model_executor.cpu.kernels.packing import (
    Q4_BLOCK_BYTES,
    Q4K_BLOCK_BYTES,
    Q4KS_BLOCK_BYTES,
    Q5K_BLOCK_BYTES,
    Q6K_BLOCK_BYTES,
    Q6KS_BLOCK_BYTES,
    Q8_BLOCK_BYTES,
    Int8Weight,
)

GEMV_MAX_ROWS = 4  # cpu_kernels.c: srt_gemv serves up to this many rows
# Decode batches up to this size run each layer as one srt_decode_layer call where srt_gemv has its
# AVX-512 BF16 loop (fused_gemv_max_batch). Measured against the op-by-op path on SmolLM2: faster
# at batch 1 and 2, slower at 4 (there the oneDNN GEMMs beat srt_gemv; docs/performance.md).
FUSED_DECODE_MAX_BATCH = 2
# Where gguf_rows_exact() does not hold, the GGUF block kernels take at most these rows:
# a linear runs on the Q4_1 weight for at most this many rows (measured on SmolLM2, see
# docs/performance.md), on the bf16 copy for more.
Q4_MAX_ROWS = 12
# ... and at most this many where srt_gguf_linear runs on AMX tiles: widening the blocks and
# multiplying on the tiles takes a flat ~1.7 ms on a 17920 x 1536 Q4_K gate_up weight from 1 to 32
# rows, where the 4-bit kernel takes 0.77 ms at 2 rows, 1.33 at 4, 1.71 at 5 and 2.55 at 8 (the
# 2-core AMX Xeon, 12-07; 1536 x 8960 and 2048 x 1536 cross at 5 rows too).
Q4_AMX_MAX_ROWS = 4
# The LM head runs on its Q8_0 weight for at most this many rows (measured on SmolLM2, see
# docs/performance.md), on the bf16 copy for more.
Q8_MAX_ROWS = 8
# A Q6_K layer runs on its blocks for at most this many rows: streaming 640 x 2048 layers
# (scripts/bench_gguf_kernels.py, Zen 4) they were 1.4-1.6x the bf16 copy's speed at 1 row, 0.95-1.4x
# at 2 and 0.7-1.04x at 4 on AVX-512 VNNI, and on the AVX2 path 1.03-1.07x at 2 rows and 0.9x at 4
# (two scales a block cost more than Q8_0's one; docs/performance.md).
Q6K_MAX_ROWS = 2
# ... and at least this many where srt_gguf_linear runs on AMX tiles: the Q6_K kernel took 0.96 ms
# at 8 rows on a 1536 x 8960 layer and 1.87 on a 17920 x 1536 one where widening onto the tiles took
# 0.91 and 2.08 (the 2-core AMX Xeon, 12-07; 1-6 rows further ahead).
Q6K_AMX_MAX_ROWS = 8
# A Q5_K layer runs on its blocks for at most this many rows: streaming 640 x 2048 layers
# (scripts/bench_gguf_kernels.py, Zen 4, shared, two runs) they were 1.14-1.53x the bf16 copy's speed
# at 1 row, 1.00-1.09x at 2 and 0.71-0.82x at 3 to 8 on AVX-512 BF16; on the AVX2 path 1.03-1.32x at
# 1 row, 1.00-1.30x at 2 and 0.97-1.17x at 3 (the fifth bits cost vector work per weight that Q4_K's
# do not; docs/performance.md).
Q5K_MAX_ROWS = 2


# Whether GGUF weights take every row count on their blocks (where gguf_rows_exact()): set by the CPU
# wing for a server that needs a row's bits independent of its batch (speculation, deterministic
# inference). Off, prefills and large batches run on the blocks widened to bf16 weights: 1.36x and 1.47x
# the prefill tok/s of the 1.5B coder at batch 1 and 32 (docs/performance.md).
exact_rows = False


@functools.cache
def gguf_rows_exact() -> bool:
    """Whether the GGUF block kernels take every row count here, each row's sums the same bits
    whatever else the call holds: their AVX-512 BF16 and VNNI paths without AMX tiles (many rows
    widen the blocks once, to the values the few-row tiles build, and run the same sums). Then
    --quantization gguf is batch-invariant, as bf16 is. Elsewhere a call past the row limits below
    runs on the blocks widened to bf16 weights (other sums), and the AVX2 paths keep more partial
    sums for fewer rows."""
    return build.bf16_linear_isa() == "AVX-512 BF16" and build.q6ks_available()


def gguf_every_row() -> bool:
    """Whether GGUF weights run on their blocks at every row count in this process: asked for
    (exact_rows) and taken alike here (gguf_rows_exact)."""
    return exact_rows and gguf_rows_exact()


def q4_max_rows(packed: torch.Tensor) -> int:
    """The most rows srt_q4_linear / srt_q4k_linear / srt_q5k_linear takes the packed 4-bit (or Q5_K)
    weight for."""
    if gguf_every_row():
        return sys.maxsize
    if packed.shape[-1] == Q5K_BLOCK_BYTES:
        return Q5K_MAX_ROWS
    return min(Q4_MAX_ROWS, Q4_AMX_MAX_ROWS) if _gguf_on_tiles() else Q4_MAX_ROWS


def _gguf_on_tiles() -> bool:
    """Whether srt_gguf_linear runs on AMX tiles in this process (both answers are cached)."""
    return build.gguf_linear_available() and build.amx_available()


def q8_max_rows(packed: torch.Tensor) -> int:
    """The most rows srt_q8_linear / srt_q6k_linear takes the packed 8-bit weight for."""
    if gguf_every_row():
        return sys.maxsize
    if packed.shape[-1] not in (Q6K_BLOCK_BYTES, Q6KS_BLOCK_BYTES):
        return Q8_MAX_ROWS
    return max(Q6K_MAX_ROWS, Q6K_AMX_MAX_ROWS) if _gguf_on_tiles() else Q6K_MAX_ROWS


def fused_gemv_max_batch() -> int:
    """The largest decode batch whose layers run fused on srt_gemv (weights not packed for our
    kernels): FUSED_DECODE_MAX_BATCH with AVX-512 BF16; none without, where srt_gemv's plain loops
    made a batch-1 step of SmolLM2 several times slower than torch's linears
    (docs/performance.md)."""
    lib = build.kernels()
    return FUSED_DECODE_MAX_BATCH if lib is not None and lib.srt_dp_linear_available() else 0


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: all bf16 on the CPU, rows with a contiguous last dimension."""
    return (
        all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
        and build.kernels() is not None
    )


def computes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels give a result of `dtype` on `device` from float32 inputs (a LayerNorm's,
    a GELU's, an encoder's attention): bf16 on the CPU, with the kernels built."""
    return dtype == torch.bfloat16 and device.type == "cpu" and build.kernels() is not None


def data_ptr(t: torch.Tensor | None) -> int | None:
    """t's data pointer, or None (NULL) for an absent optional tensor (a bias, a residual)."""
    return None if t is None else t.data_ptr()


def _library() -> ctypes.CDLL:
    lib = build.kernels()
    if lib is None:
        raise RuntimeError(
            "the CPU kernels are not loaded (SRT_CPU_KERNELS=0, no compiler, or the build failed): "
            "check usable() before calling an op"
        )
    return lib


def _need_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got shape {tuple(t.shape)} with strides {t.stride()}")


def _need_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}; got {t.dtype}")


def _need_gate_up(name: str, packed: torch.Tensor) -> None:
    if packed.shape[0] % 2:
        raise ValueError(
            f"{name} must hold gate rows then up rows: an even number of 16-output blocks; "
            f"got {packed.shape[0]}"
        )


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    keep_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(x + residual) * weight, x + residual); x [rows, dim] bf16 or float32 (a layer's
    float32 output), the residual stream float32, contiguous. Only the first output is rounded to
    bf16. Without a residual the second is None, or x widened with `keep_residual` (a decoder's
    first layer starts the stream)."""
    lib = _library()
    _need_contiguous("x", x)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be torch.bfloat16 or torch.float32; got {x.dtype}")
    if residual is not None:
        _need_contiguous("residual", residual)
        _need_dtype("residual", residual, torch.float32)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    residual_out = (
        torch.empty(x.shape, dtype=torch.float32) if residual is not None or keep_residual else None
    )
    lib.srt_rmsnorm(
        x.data_ptr(),
        int(x.dtype == torch.float32),
        data_ptr(residual),
        weight.data_ptr(),
        out.data_ptr(),
        data_ptr(residual_out),
        x.numel() // dim,
        dim,
        eps,
    )
    return out, residual_out


def rmsnorm_f32w(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(x + residual) * weight in out_dtype (bf16 or float32), x + residual) with a float32
    weight (Gemma's 1 + w); x [rows, dim] bf16 or float32, the residual float32, contiguous."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("weight", weight, torch.float32)
    if residual is not None:
        _need_contiguous("residual", residual)
        _need_dtype("residual", residual, torch.float32)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype)
    residual_out = torch.empty(x.shape, dtype=torch.float32) if residual is not None else None
    lib.srt_rmsnorm_f32w(
        x.data_ptr(),
        int(x.dtype == torch.float32),
        data_ptr(residual),
        weight.data_ptr(),
        out.data_ptr(),
        int(out_dtype == torch.float32),
        data_ptr(residual_out),
        x.numel() // dim,
        dim,
        eps,
    )
    return out, residual_out


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    with_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(layernorm(x + residual) * weight + bias in float32, the same rounded to bf16 where
    `with_bf16`, else None); x [rows, dim] bf16 or float32, the residual, weight and bias float32,
    contiguous."""
    lib = _library()
    _need_contiguous("x", x)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be torch.bfloat16 or torch.float32; got {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None:
            _need_contiguous(name, t)
            _need_dtype(name, t, torch.float32)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float32)
    out_bf16 = torch.empty(x.shape, dtype=torch.bfloat16) if with_bf16 else None
    lib.srt_layernorm(
        x.data_ptr(),
        int(x.dtype == torch.float32),
        data_ptr(residual),
        weight.data_ptr(),
        bias.data_ptr(),
        out.data_ptr(),
        data_ptr(out_bf16),
        x.numel() // dim,
        dim,
        eps,
    )
    return out, out_bf16


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """x float32, contiguous -> gelu(x) (the exact, erf GELU) in bf16, rounded once."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.float32)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.srt_gelu_erf(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: Sequence[int], head_dim: int, scale: float
) -> torch.Tensor:
    """An encoder's attention, every token attending to all of its own request's: q, k, v float32
    [tokens, heads * head_dim] views of one [tokens, *] tensor (a qkv projection's output: rows of
    one stride, heads and head_dim contiguous), the requests' tokens packed one after another
    (`lens`, each positive). Returns bf16 [tokens, heads * head_dim], rounded once
    (srt_encoder_attention)."""
    lib = _library()
    n, width = q.shape
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.shape != q.shape or t.stride() != (q.stride(0), 1):
            raise ValueError(
                f"{name} must be float32 [{n}, {width}] rows of q's stride {q.stride(0)}; got "
                f"{t.dtype} {tuple(t.shape)} with strides {t.stride()}"
            )
    if sum(lens) != n or min(lens, default=0) <= 0 or width % head_dim:
        raise ValueError(f"lens {list(lens)} must be positive and sum to {n}; heads of {head_dim} in {width}")
    lens_t = torch.tensor(lens, dtype=torch.int64)
    out = torch.empty(n, width, dtype=torch.bfloat16)
    lib.srt_encoder_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), out.data_ptr(),
        lens_t.data_ptr(), len(lens), width // head_dim, head_dim, scale,
    )  # fmt: skip
    return out


def _bert_layer_scratch_size(tokens: int, hidden: int, inter: int) -> int:
    """srt_bert_layer's float32 values of working memory: tokens (5.5 hidden + 1.5 inter)."""
    return tokens * (11 * hidden + 3 * inter) // 2


def bert_layer_scratch(tokens: int, hidden: int, inter: int) -> torch.Tensor:
    """srt_bert_layer's working memory for `tokens` tokens, float32."""
    return torch.empty(_bert_layer_scratch_size(tokens, hidden, inter), dtype=torch.float32)


def bert_layer(
    h: torch.Tensor,
    hb: torch.Tensor,
    lens: torch.Tensor,
    params: torch.Tensor,
    eps: float,
    head_dim: int,
    inter: int,
    scratch: torch.Tensor,
) -> None:
    """One BERT layer in place (srt_bert_layer): h [tokens, hidden] float32 and hb, the same in bf16,
    contiguous; lens int64, the requests' token counts; params int64, the addresses of the layer's
    12 parameters in srt_bert_layer's order; scratch from bert_layer_scratch."""
    lib = _library()
    n, hidden = h.shape
    _need_contiguous("h", h)
    _need_dtype("h", h, torch.float32)
    _need_contiguous("hb", hb)
    _need_dtype("hb", hb, torch.bfloat16)
    if hb.shape != h.shape or int(lens.sum()) != n or params.numel() != 12 or hidden % head_dim:
        raise ValueError(
            f"hb {tuple(hb.shape)} must be h's {tuple(h.shape)}, lens sum to {n}, params hold 12 addresses "
            f"(got {params.numel()}), heads of {head_dim} divide {hidden}"
        )
    size = _bert_layer_scratch_size(n, hidden, inter)
    if scratch.dtype != torch.float32 or scratch.numel() < size:
        raise ValueError(f"scratch must be float32 of {size} values")
    lib.srt_bert_layer(
        h.data_ptr(), hb.data_ptr(), n, hidden, inter, params.data_ptr(), eps,
        lens.data_ptr(), len(lens), head_dim, head_dim**-0.5, scratch.data_ptr(),
    )  # fmt: skip


def _gated(kernel: str, x: torch.Tensor) -> torch.Tensor:
    """[.., 2d] (gate | up) -> act(gate) * up by the kernel `kernel` of the library; x contiguous."""
    lib = _library()
    _need_contiguous("x", x)
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    getattr(lib, kernel)(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2d] (gate | up) -> silu(gate) * up; x contiguous."""
    return _gated("srt_silu_mul", x)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2d] bf16 (gate | up) -> gelu_tanh(gate) * up (Gemma's GeGLU); x contiguous."""
    return _gated("srt_gelu_tanh_mul", x)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d] (rows may be strided, heads contiguous) -> rotated contiguous copy."""
    lib = _library()
    n, heads, d = x.shape
    if x.stride(1) != d:
        raise ValueError(f"x's heads must be contiguous (stride {d} along dim 1); got strides {x.stride()}")
    _need_dtype("positions", positions, torch.int64)
    _need_contiguous("cos", cos)
    out = torch.empty(n, heads, d, dtype=x.dtype)
    lib.srt_rope(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        n,
        heads,
        d,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Writes k/v [bs, kv_heads*d] at out_loc, then attends q [bs, heads*d] over each request's
    seq_lens[b] slots of row rows[b] in req_to_token (with a sliding `window`, its last `window`
    slots only; with `softcap` each score s capped to softcap * tanh(s / softcap)). Returns [bs, heads*d]."""
    lib = _library()
    bs = q.shape[0]
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("req_to_token", req_to_token)):
        _need_contiguous(name, tensor)
    for name, index in (("out_loc", out_loc), ("rows", rows), ("seq_lens", seq_lens)):
        if index.dtype != torch.int64 or not index.is_contiguous() or index.numel() != bs:
            raise ValueError(
                f"{name} must be {bs} contiguous int64 values (one per row of q); got {index.numel()} "
                f"{index.dtype}, contiguous={index.is_contiguous()}"
            )
    _need_dtype("req_to_token", req_to_token, torch.int64)
    out = torch.empty(bs, num_heads * head_dim, dtype=q.dtype)
    lib.srt_decode_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out_loc.data_ptr(),
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        rows.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        bs,
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        max_len,
        window or 0,
        softcap or 0.0,
    )
    return out


def prefill_attention_applies(q: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `prefill_attention` runs here: bf16 on a CPU with AMX or AVX-512 BF16, head size 64 or 128."""
    return (
        head_dim in (64, 128)
        and num_heads % num_kv_heads == 0
        and usable(q)
        and build.prefill_kernel_available()
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: Sequence[int],
    scale: float,
    prefix_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention of requests' new tokens packed one after another: q [new tokens, heads, d];
    k/v [keys, kv_heads, d] hold each request's prefix_lens[i] cached keys then its lens[i] new ones
    (no prefixes: k/v are the new tokens' own). Rows may be strided (heads and d contiguous).
    Returns [new tokens, heads * d]. On AMX tiles or AVX-512 BF16 (cpu_prefill_attention.c); check
    `prefill_attention_applies` first."""
    lib = _library()
    n, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    prefixes = torch.tensor(
        list(prefix_lens) if prefix_lens is not None else [0] * len(lens), dtype=torch.int64
    )
    lens_t = torch.tensor(list(lens), dtype=torch.int64)
    if len(prefixes) != len(lens_t):
        raise ValueError(f"prefix_lens must have one entry per request ({len(lens_t)}); got {len(prefixes)}")
    keys = lens_t + prefixes  # per request
    if int(lens_t.sum()) != n:
        raise ValueError(f"lens must sum to q's {n} rows; got {int(lens_t.sum())}")
    if d not in (64, 128):
        raise ValueError(f"the head size (q.shape[2]) must be 64 or 128; got {d}")
    for name, t, rows in (("q", q, n), ("k", k, int(keys.sum())), ("v", v, int(keys.sum()))):
        _need_dtype(name, t, torch.bfloat16)
        if t.stride(2) != 1 or t.stride(1) != d or t.shape[0] != rows:
            raise ValueError(
                f"{name} must be [{rows}, heads, {d}] with heads and d contiguous; got shape "
                f"{tuple(t.shape)} with strides {t.stride()}"
            )
    starts = torch.cumsum(lens_t, 0) - lens_t
    kstarts = torch.cumsum(keys, 0) - keys
    out = torch.empty(n, num_heads * d, dtype=torch.bfloat16)
    lib.srt_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        out.data_ptr(),
        starts.data_ptr(),
        kstarts.data_ptr(),
        lens_t.data_ptr(),
        prefixes.data_ptr(),
        len(lens),
        num_heads,
        num_kv_heads,
        d,
        scale,
    )
    return out


def store_kv_applies(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor
) -> bool:
    """Whether store_kv takes these: bf16 [n, kv heads, d] rows with each row's values contiguous
    (column slices of a qkv output are), contiguous caches of the same width, int64 slots."""
    return (
        usable(k, v, k_cache, v_cache)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and loc.dtype == torch.int64
        and loc.is_contiguous()
        and k.shape == v.shape
        and k.shape[1:] == k_cache.shape[1:] == v_cache.shape[1:]
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor
) -> None:
    """k_cache[loc] = k and v_cache[loc] = v (see store_kv_applies), rows copied in parallel."""
    lib = _library()
    n, width = k.shape[0], k.shape[1] * k.shape[2]
    lib.srt_store_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        loc.data_ptr(),
        n,
        width,
    )


def set_split_threads(threads: int) -> None:
    """Fix the thread count decode attention's splits are a multiple of (0: the call's threads), so
    a rank whose threads change while it serves keeps each request's output bits. No-op where the
    kernels are not loaded."""
    lib = build.kernels()
    if lib is not None:
        lib.srt_set_split_threads(threads)


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """logits.argmax(-1) for [rows, n] float32 CPU logits (None where the kernel does not apply)."""
    lib = build.kernels()
    if (
        lib is None
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or not logits.is_contiguous()
    ):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.srt_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., k] with at most GEMV_MAX_ROWS rows, weight [n, k] -> x @ weight.T (+ bias), bf16."""
    lib = _library()
    k = x.shape[-1]
    m = x.numel() // k
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"x must have 1 to {GEMV_MAX_ROWS} rows; got {m}")
    _need_contiguous("x", x)
    _need_contiguous("weight", weight)
    n = weight.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    lib.srt_gemv(x.data_ptr(), m, weight.data_ptr(), data_ptr(bias), out.data_ptr(), n, k)
    return out


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x [.., k] bf16 -> x @ weight.T (+ bias) for the weight `packed` holds (see bf16_pack), in bf16,
    or in float32 (the fp32 sums unrounded: an LM head's logits)."""
    lib = _library()
    _need_contiguous("x", x)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32; got {out_dtype}")
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=out_dtype)
    fn = lib.srt_bf16_linear if out_dtype == torch.bfloat16 else lib.srt_bf16_linear_f32
    fn(x.data_ptr(), m, packed.data_ptr(), data_ptr(bias), out.data_ptr(), n, k)
    return out


def bf16_linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [.., k] bf16 and a packed gate_up weight [2d, k] (gate rows, then up rows; see bf16_pack)
    -> silu(x @ gate.T) * (x @ up.T) [.., d] in one pass, equal to silu_mul(bf16_linear(x, packed))."""
    lib = _library()
    _need_contiguous("x", x)
    _need_gate_up("packed", packed)
    d, k = packed.shape[0] * 8, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    lib.srt_bf16_linear_silu(x.data_ptr(), m, packed.data_ptr(), out.data_ptr(), d, k)
    return out


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., k] bf16 -> x @ (q * scale).T (+ bias) in bf16, x quantized to int8 per row."""
    lib = _library()
    packed = weight.packed
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    n, k = packed.shape[0] * 16, packed.shape[1] * 64
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    lib.srt_int8_linear(
        x.data_ptr(), m, packed.data_ptr(), weight.scale.data_ptr(), data_ptr(bias), out.data_ptr(), n, k
    )
    return out


def int8_linear_silu(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [.., k] bf16 and an int8 gate_up weight [2d, k] (gate rows, then up rows) -> silu(gate) * up
    [.., d] in one pass, equal to silu_mul(int8_linear(x, weight, None))."""
    lib = _library()
    packed = weight.packed
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    _need_gate_up("weight.packed", packed)
    d, k = packed.shape[0] * 8, packed.shape[1] * 64
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    lib.srt_int8_linear_silu(
        x.data_ptr(), m, packed.data_ptr(), weight.scale.data_ptr(), out.data_ptr(), d, k
    )
    return out


def _q4_kernel(lib: ctypes.CDLL, packed: torch.Tensor, silu: bool) -> Callable[..., object]:
    """The kernel for a packed Q4_1, Q4_K (either layout) or Q5_K weight, told apart by its block size."""
    kind = {Q4K_BLOCK_BYTES: "q4k", Q4KS_BLOCK_BYTES: "q4ks", Q5K_BLOCK_BYTES: "q5k"}.get(
        packed.shape[-1], "q4"
    )
    return getattr(lib, f"srt_{kind}_linear{'_silu' if silu else ''}")


def q4_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x [.., k] bf16 -> x @ (d q + m).T (+ bias) in bf16, or float32 unrounded, for the weight
    `packed` holds (q4_pack: Q4_1's fp16 d and m, or Q4_K's fp32 ones, on srt_q4k_linear; q4ks_pack:
    Q4_K's six-bit scales, on srt_q4ks_linear; q5k_pack: Q5_K's, on srt_q5k_linear)."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=out_dtype)
    if out_dtype == torch.float32:
        lib.srt_q4_linear_f32(
            x.data_ptr(),
            m,
            packed.data_ptr(),
            GGUF_KINDS[packed.shape[-1]],
            data_ptr(bias),
            out.data_ptr(),
            n,
            k,
        )
        return out
    _q4_kernel(lib, packed, silu=False)(
        x.data_ptr(), m, packed.data_ptr(), data_ptr(bias), out.data_ptr(), n, k
    )
    return out


def q4_linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [.., k] bf16 and a Q4_1, Q4_K or Q5_K gate_up weight [2d, k] (gate rows, then up rows) ->
    silu(gate) * up [.., d] in one pass, equal to silu_mul(q4_linear(x, packed, None))."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    _need_gate_up("packed", packed)
    d, k = packed.shape[0] * 8, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    _q4_kernel(lib, packed, silu=True)(x.data_ptr(), m, packed.data_ptr(), out.data_ptr(), d, k)
    return out


def q8_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [.., k] bf16 -> x @ (d q).T in float32, for the weight `packed` holds (q8_pack: fp16 d a
    run of 32, or Q6_K's fp32 d a run of 16, on srt_q6k_linear)."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    kernel = {Q6K_BLOCK_BYTES: lib.srt_q6k_linear, Q6KS_BLOCK_BYTES: lib.srt_q6ks_linear}.get(
        packed.shape[-1], lib.srt_q8_linear
    )
    kernel(x.data_ptr(), x.numel() // k, packed.data_ptr(), out.data_ptr(), n, k)
    return out


# srt_decode_layer's and srt_gguf_linear's kind of a GGUF weight (gguf_layouts.h's GGUF_*), by its packed block's bytes
GGUF_KINDS = {
    Q4_BLOCK_BYTES: 1,
    Q4K_BLOCK_BYTES: 2,
    Q4KS_BLOCK_BYTES: 6,
    Q5K_BLOCK_BYTES: 3,
    Q8_BLOCK_BYTES: 4,
    Q6K_BLOCK_BYTES: 5,
    Q6KS_BLOCK_BYTES: 7,
}


def gguf_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x [.., k] bf16 -> x @ w.T (+ bias), any number of rows, for the GGUF blocks `packed` holds
    (q4_pack's, q5k_pack's or q8_pack's layout), widened to bf16 a task at a time: the bits
    srt_bf16_linear gives on the weight's bf16 copy (without AMX). bf16 or float32 out."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    out = torch.empty(*x.shape[:-1], n, dtype=out_dtype)
    mode = 1 if out_dtype == torch.float32 else 0
    lib.srt_gguf_linear(
        x.data_ptr(),
        x.numel() // k,
        packed.data_ptr(),
        GGUF_KINDS[packed.shape[-1]],
        data_ptr(bias),
        out.data_ptr(),
        n,
        k,
        mode,
    )
    return out


def gguf_linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x @ w.T for the GGUF blocks of a [2d, k] gate_up weight, any rows."""
    lib = _library()
    _need_contiguous("x", x)
    _need_dtype("x", x, torch.bfloat16)
    d, k = packed.shape[0] * 8, packed.shape[1] * 32
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    lib.srt_gguf_linear(
        x.data_ptr(),
        x.numel() // k,
        packed.data_ptr(),
        GGUF_KINDS[packed.shape[-1]],
        None,
        out.data_ptr(),
        d,
        k,
        2,
    )
    return out


def lora_slot_words() -> int | None:
    """The int64 words of one adapter slot in srt_lora_delta's table, or None without the kernels."""
    lib = build.kernels()
    return None if lib is None else int(lib.srt_lora_slot_words())


def lora_delta(out: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, table: torch.Tensor) -> bool:
    """Adds each row's LoRA delta (srt_lora_delta; `table` as lora/linear_method.py writes it) into
    out [m, n] (bf16 or float32, in place) from x [m, k] (bf16 or float32), row i under slot
    row_slots[i] (int32, -1: none). False, touching nothing, where the kernel does not apply."""
    lib = build.kernels()
    floats = (torch.bfloat16, torch.float32)
    if (
        lib is None
        or out.dim() != 2
        or x.dim() != 2
        or out.shape[0] != x.shape[0]
        or out.dtype not in floats
        or x.dtype not in floats
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in (out, x, row_slots, table))
        or row_slots.dtype != torch.int32
        or row_slots.numel() != x.shape[0]
        or table.dtype != torch.int64
    ):
        return False
    m, k = x.shape
    lib.srt_lora_delta(
        x.data_ptr(),
        int(x.dtype == torch.float32),
        m,
        k,
        out.data_ptr(),
        int(out.dtype == torch.float32),
        out.shape[1],
        row_slots.data_ptr(),
        table.data_ptr(),
        table.shape[0],
    )
    return True
