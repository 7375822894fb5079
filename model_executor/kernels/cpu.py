"""Builds cpu_kernels.c once per machine and calls it on tensors' data pointers through ctypes.

The shared object is cached under ~/.cache/srt/kernels (SRT_KERNEL_CACHE overrides), keyed by
the source, the compiler, its flags and the CPU's feature flags (it is built with
-march=native). Every rank of every process loads the same file; a build writes a temporary file
and renames it, so ranks that race build twice at worst, never read half a file.

When there is no C compiler, the build fails, or SRT_CPU_KERNELS=0, `kernels()` is None and the
layers keep their torch ops: same results within bf16 rounding, more time per step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("srt.kernels")

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_kernels.c", "cpu_amx.c", "cpu_bf16_linear.c", "cpu_int8_linear.c",
                             "cpu_q4_linear.c", "cpu_q8_linear.c", "cpu_prefill_attention.c"))
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("simd_bf16.h", "dp_bf16.h", "prefill_tasks.h"))  # part of the build key
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "srt_rmsnorm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "srt_silu_mul": [_ptr, _ptr, _i64, _i64],
    "srt_rope": [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "srt_decode_attention": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr,
                             _i64, _i64, _i64, _i64, _f32, _i64],
    "srt_gemv": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_argmax": [_ptr, _i64, _i64, _ptr],
    "srt_store_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_bf16_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_bf16_linear_f32": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_bf16_linear_silu": [_ptr, _i64, _ptr, _ptr, _i64, _i64],
    "srt_int8_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_int8_linear_silu": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_q4_linear": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64],
    "srt_q4_linear_silu": [_ptr, _i64, _ptr, _ptr, _i64, _i64],
    "srt_q8_linear": [_ptr, _i64, _ptr, _ptr, _i64, _i64],
    "srt_prefill_attention": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                                  _i64, _i64, _f32],
    "srt_decode_layer": [_ptr, _ptr, _i64, _ptr, _ptr, _f32,  # hidden, residual, first, ln1, ln2, eps
                         *[_ptr] * 13,  # w_qkv, b_qkv, w_o, w_gate_up, w_down, their packed copies, int8 scales
                         _i64,  # q4: the packed copies are Q4_1 (q4_pack)
                         *[_ptr] * 7, _i64,  # positions, cos, sin, k/v cache, out_loc, req_to_token, stride
                         _ptr, _ptr, *[_i64] * 7, _f32,  # rows, seq_lens, max_len, m, 4 sizes, scale
                         *[_ptr] * 6],  # scratch, out
}
GEMV_MAX_ROWS = 4  # cpu_kernels.c: srt_gemv serves up to this many rows
# Decode batches up to this size run each layer as one srt_decode_layer call where srt_gemv has its
# AVX-512 BF16 loop (fused_gemv_max_batch). Measured against the op-by-op path on SmolLM2: 25%
# faster at batch 1, a little at 2, slower at 4 (there the oneDNN GEMMs beat srt_gemv).
FUSED_DECODE_MAX_BATCH = 2


def fused_gemv_max_batch() -> int:
    """The largest decode batch whose layers run fused on srt_gemv (weights not packed for our
    kernels): FUSED_DECODE_MAX_BATCH with AVX-512 BF16; none without, where srt_gemv's plain loops
    made a batch-1 step of SmolLM2 ~4x slower than torch's linears (docs/performance.md)."""
    lib = kernels()
    return FUSED_DECODE_MAX_BATCH if lib is not None and lib.srt_dp_linear_available() else 0


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cc, version, *CFLAGS, _cpu_flags()]).encode()).hexdigest()
    cache = Path(os.environ.get("SRT_KERNEL_CACHE") or Path.home() / ".cache" / "srt" / "kernels")
    target = cache / f"cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernels: %s", target)
    return target


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where the torch ops are used instead."""
    if os.environ.get("SRT_CPU_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU kernels unavailable, using torch ops (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using torch ops (slower): %s", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    for name in ("srt_amx_init", "srt_amx_has_int8", "srt_dp_linear_available", "srt_vnni_linear_available",
                 "srt_q4_linear_available", "srt_q8_linear_available", "srt_dp_prefill_attention_available"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], _i64
    return lib


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernels run here: built for a CPU with AMX-BF16, and the OS lets this
    process use the tiles (SRT_AMX=0 turns them off). Asking grants the tiles to the process, and
    from then on srt_bf16_linear runs on them."""
    lib = kernels()
    return lib is not None and os.environ.get("SRT_AMX", "1") != "0" and bool(lib.srt_amx_init())


@functools.cache
def bf16_linear_available() -> bool:
    """Whether srt_bf16_linear runs here: on AMX tiles, or else on AVX-512 BF16 (cpu_bf16_linear.c)."""
    lib = kernels()
    return lib is not None and (amx_available() or bool(lib.srt_dp_linear_available()))


def bf16_packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] bf16 -> the order srt_bf16_linear streams it in: [n/16, k/32, 16 (k pairs), 16 (n), 2]
    (an AMX B tile per 32-wide slice of k; one vdpbf16ps operand per k pair)."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [.., k] bf16 -> x @ weight.T (+ bias) for the weight `packed` holds (see bf16_pack), in bf16,
    or in float32 (the bf16 values widened: what .float() of the bf16 output gives, in one pass)."""
    lib = kernels()
    assert lib is not None and x.is_contiguous() and out_dtype in (torch.bfloat16, torch.float32)
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=out_dtype)
    fn = lib.srt_bf16_linear if out_dtype == torch.bfloat16 else lib.srt_bf16_linear_f32
    fn(x.data_ptr(), m, packed.data_ptr(), _p(bias), out.data_ptr(), n, k)
    return out


def bf16_linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [.., k] bf16 and a packed gate_up weight [2d, k] (gate rows, then up rows; see bf16_pack)
    -> silu(x @ gate.T) * (x @ up.T) [.., d] in one pass, equal to silu_mul(bf16_linear(x, packed))."""
    lib = kernels()
    assert lib is not None and x.is_contiguous() and packed.shape[0] % 2 == 0
    d, k = packed.shape[0] * 8, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    lib.srt_bf16_linear_silu(x.data_ptr(), m, packed.data_ptr(), out.data_ptr(), d, k)
    return out


@functools.cache
def int8_available() -> bool:
    """Whether srt_int8_linear runs here: on AMX int8 tiles where AMX is granted, else on AVX-512 VNNI."""
    lib = kernels()
    if lib is None:
        return False
    return bool(lib.srt_amx_has_int8()) if amx_available() else bool(lib.srt_vnni_linear_available())


def int8_packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.device.type == "cpu" and weight.is_floating_point() and n % 32 == 0 and k % 64 == 0


@dataclass(frozen=True)
class Int8Weight:
    """A weight for srt_int8_linear: int8 in its tile order [n/16, k/64, 16 (k quads), 16 (n), 4]
    and one fp32 scale per output (w ~ q * scale). For AMX `packed` holds q (torch.int8); for the
    AVX-512 VNNI path, whose products take one operand unsigned, q + 128 (torch.uint8)."""

    packed: torch.Tensor
    scale: torch.Tensor


def int8_pack(weight: torch.Tensor) -> Int8Weight:
    """[n, k] -> its Int8Weight for the path srt_int8_linear takes here: symmetric per-output
    quantization (absmax / 127), |q| <= 127."""
    n, k = weight.shape
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    if not amx_available():
        q = (q.to(torch.int16) + 128).to(torch.uint8)
    return Int8Weight(q.view(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous(), scale.contiguous())


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., k] bf16 -> x @ (q * scale).T (+ bias) in bf16, x quantized to int8 per row."""
    lib = kernels()
    packed = weight.packed
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    n, k = packed.shape[0] * 16, packed.shape[1] * 64
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    lib.srt_int8_linear(x.data_ptr(), m, packed.data_ptr(), weight.scale.data_ptr(), _p(bias), out.data_ptr(), n, k)
    return out


def int8_linear_silu(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [.., k] bf16 and an int8 gate_up weight [2d, k] (gate rows, then up rows) -> silu(gate) * up
    [.., d] in one pass, equal to silu_mul(int8_linear(x, weight, None))."""
    lib = kernels()
    packed = weight.packed
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16 and packed.shape[0] % 2 == 0
    d, k = packed.shape[0] * 8, packed.shape[1] * 64
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    lib.srt_int8_linear_silu(x.data_ptr(), m, packed.data_ptr(), weight.scale.data_ptr(), out.data_ptr(), d, k)
    return out


@functools.cache
def q4_available() -> bool:
    """Whether srt_q4_linear runs here (AVX-512 BF16: cpu_q4_linear.c)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q4_linear_available())


Q4_BLOCK_BYTES = 320  # cpu_q4_linear.c: 16 outputs x 32 k of Q4_1 (fp16 d and m, then the nibbles)


def q4_recover(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The GGUF Q4_1 blocks behind a float32 [n, k] weight, if it is one: (q [n, k] uint8 in 0..15,
    d [n, k/32] and m [n, k/32] fp16) with float32(d * q + m) equal to every value, as gguf-py and
    llama.cpp dequantize; None where some 32-value run along k is not such a block (k % 32 != 0,
    or a weight that was never Q4_1). Each block's m is its smallest value and its d (largest -
    smallest) / 15, as llama.cpp's Q4_1 quantizer sets them; every value is checked."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32:
        return None
    w = weight.detach().view(n, k // 32, 32)
    low, high = w.amin(-1), w.amax(-1)
    m = low.half()
    d = ((high - low) / 15).half()
    if not (torch.isfinite(w).all() and (m.float() == low).all() and torch.isfinite(d).all()):
        return None
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, torch.round((w - mf) / torch.where(df > 0, df, 1.0)), 0.0).clamp(0, 15)
    if not torch.equal(df * q + mf, w):
        return None
    return q.to(torch.uint8).view(n, k), d, m


def q4_pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (q_recover's form) -> srt_q4_linear's order, [n/16, k/32, 320] uint8: per 16
    outputs and 32 k, 16 d and 16 m (fp16), then for each quad of k 32 bytes: byte 2j q[j][4c] |
    q[j][4c + 2] << 4, byte 2j + 1 q[j][4c + 1] | q[j][4c + 3] << 4. n % 16 == 0."""
    n, k = q.shape
    blocks = k // 32
    scales = torch.stack([d, m], dim=1).view(n // 16, 16, 2, blocks).permute(0, 3, 2, 1)  # [n/16, kb, 2, 16]
    scales = scales.contiguous().view(torch.uint8).reshape(n // 16, blocks, 64)
    quads = q.view(n // 16, 16, blocks, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)  # [n/16, kb, c, j, pair, low/high]
    nibbles = (quads[..., 0] | (quads[..., 1] << 4)).reshape(n // 16, blocks, 256)
    return torch.cat([scales, nibbles], dim=-1).contiguous()


@dataclass(frozen=True)
class Q4Weight:
    """A layer's GGUF Q4_1 weight for srt_q4_linear (decode steps of up to Q4_MAX_ROWS rows) and
    its bf16 copy packed for srt_bf16_linear (more rows: a prefill, a big decode batch)."""

    packed: torch.Tensor  # q4_pack's [n/16, k/32, 320]
    bf16: torch.Tensor  # bf16_pack's


# A linear runs on the Q4_1 weight for at most this many rows (measured on SmolLM2, see
# docs/performance.md), on the bf16 copy for more.
Q4_MAX_ROWS = 12


def q4_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., k] bf16 -> x @ (d q + m).T (+ bias) in bf16, for the weight `packed` holds (q4_pack)."""
    lib = kernels()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    lib.srt_q4_linear(x.data_ptr(), m, packed.data_ptr(), _p(bias), out.data_ptr(), n, k)
    return out


def q4_linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [.., k] bf16 and a Q4_1 gate_up weight [2d, k] (gate rows, then up rows) -> silu(gate) * up
    [.., d] in one pass, equal to silu_mul(q4_linear(x, packed, None))."""
    lib = kernels()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16 and packed.shape[0] % 2 == 0
    d, k = packed.shape[0] * 8, packed.shape[1] * 32
    m = x.numel() // k
    out = torch.empty(*x.shape[:-1], d, dtype=torch.bfloat16)
    lib.srt_q4_linear_silu(x.data_ptr(), m, packed.data_ptr(), out.data_ptr(), d, k)
    return out


def q8_available() -> bool:
    """Whether srt_q8_linear runs here (AVX-512 BF16 and VNNI: cpu_q8_linear.c)."""
    lib = kernels()
    return lib is not None and bool(lib.srt_q8_linear_available())


Q8_BLOCK_BYTES = 544  # cpu_q8_linear.c: 16 outputs x 32 k of Q8_0 (fp16 d, then q + 128)


def q8_recover(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GGUF Q8_0 blocks behind a float32 [n, k] weight, if it is one: (q [n, k] int8 in -127..127,
    d [n, k/32] fp16) with float32(d * q) equal to every value; None where some run of 32 along k
    is not such a block. d is the block's largest magnitude / 127, as llama.cpp's Q8_0 quantizer
    sets it (that value's q is +-127); every value is checked."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32:
        return None
    w = weight.detach().view(n, k // 32, 32)
    d = (w.abs().amax(-1) / 127).half()
    if not (torch.isfinite(w).all() and torch.isfinite(d).all()):
        return None
    df = d.float()[..., None]
    q = torch.where(df > 0, torch.round(w / torch.where(df > 0, df, 1.0)), 0.0)
    if (q.abs() > 127).any() or not torch.equal(df * q, w):
        return None
    return q.to(torch.int8).view(n, k), d


def q8_pack(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (q8_recover's form) -> srt_q8_linear's order, [n/16, k/32, 544] uint8: per 16
    outputs and 32 k, the 16 d (fp16), then for each quad c of k 64 bytes, byte 4j + i being
    q[j][4c + i] + 128. n % 16 == 0."""
    n, k = q.shape
    blocks = k // 32
    scales = d.view(n // 16, 16, blocks).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(n // 16, blocks, 32)
    biased = (q.to(torch.int16) + 128).to(torch.uint8).view(n // 16, 16, blocks, 8, 4)
    return torch.cat([scales, biased.permute(0, 2, 3, 1, 4).reshape(n // 16, blocks, 512)], dim=-1).contiguous()


@dataclass(frozen=True)
class Q8Weight:
    """The tied LM head's GGUF Q8_0 weight for srt_q8_linear (up to Q8_MAX_ROWS rows) and its bf16
    copy packed for srt_bf16_linear (more rows)."""

    packed: torch.Tensor  # q8_pack's [n/16, k/32, 544]
    bf16: torch.Tensor  # bf16_pack's


# The LM head runs on its Q8_0 weight for at most this many rows (measured on SmolLM2, see
# docs/performance.md), on the bf16 copy for more.
Q8_MAX_ROWS = 8


def q8_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [.., k] bf16 -> x @ (d q).T in float32, for the weight `packed` holds (q8_pack)."""
    lib = kernels()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.srt_q8_linear(x.data_ptr(), x.numel() // k, packed.data_ptr(), out.data_ptr(), n, k)
    return out


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: all bf16 on the CPU, rows with a contiguous last dimension."""
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors) \
        and kernels() is not None


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(x + residual) * weight, x + residual); x and residual [rows, dim] contiguous."""
    lib = kernels()
    assert lib is not None and x.is_contiguous() and (residual is None or residual.is_contiguous())
    dim = x.shape[-1]
    out = torch.empty_like(x)
    residual_out = None if residual is None else torch.empty_like(x)
    lib.srt_rmsnorm(x.data_ptr(), _p(residual), weight.data_ptr(), out.data_ptr(), _p(residual_out),
                    x.numel() // dim, dim, eps)
    return out, residual_out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2d] (gate | up) -> silu(gate) * up; x contiguous."""
    lib = kernels()
    assert lib is not None and x.is_contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    lib.srt_silu_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d] (rows may be strided, heads contiguous) -> rotated contiguous copy."""
    lib = kernels()
    n, heads, d = x.shape
    assert lib is not None and x.stride(1) == d and positions.dtype == torch.int64 and cos.is_contiguous()
    out = torch.empty(n, heads, d, dtype=x.dtype)
    lib.srt_rope(x.data_ptr(), x.stride(0), out.data_ptr(), n, heads, d, positions.data_ptr(), cos.data_ptr(),
                 sin.data_ptr())
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, out_loc: torch.Tensor, req_to_token: torch.Tensor,
                     rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, scale: float) -> torch.Tensor:
    """Writes k/v [bs, kv_heads*d] at out_loc, then attends q [bs, heads*d] over each request's
    seq_lens[b] slots of row rows[b] in req_to_token. Returns [bs, heads*d]."""
    lib = kernels()
    assert lib is not None and k_cache.is_contiguous() and v_cache.is_contiguous() and req_to_token.is_contiguous()
    for index in (out_loc, rows, seq_lens):
        assert index.dtype == torch.int64 and index.is_contiguous() and index.numel() == q.shape[0]
    assert req_to_token.dtype == torch.int64
    bs = q.shape[0]
    out = torch.empty(bs, num_heads * head_dim, dtype=q.dtype)
    lib.srt_decode_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                             k_cache.data_ptr(), v_cache.data_ptr(), out_loc.data_ptr(), req_to_token.data_ptr(),
                             req_to_token.stride(0), rows.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), bs,
                             num_heads, num_kv_heads, head_dim, scale, max_len)
    return out


@functools.cache
def prefill_kernel_available() -> bool:
    """Whether srt_prefill_attention runs here: on AMX tiles, or else on AVX-512 BF16."""
    lib = kernels()
    return lib is not None and (amx_available() or bool(lib.srt_dp_prefill_attention_available()))


def describe_paths() -> str:
    """One start-up line: the path each kind of kernel takes on this CPU, so a slow machine says why."""
    lib = kernels()
    if lib is None:
        return "CPU kernels off (SRT_CPU_KERNELS=0 or no compiler): every op runs on torch"
    avx512 = "avx512f" in _cpu_flags().split()
    bf16 = "AMX tiles" if amx_available() else "AVX-512 BF16" if bf16_linear_available() else \
        "torch (this CPU has no AVX-512 BF16)"
    int8 = "AMX int8" if amx_available() and int8_available() else "AVX-512 VNNI" if int8_available() else \
        "refused (no VNNI)"
    prefill = "C kernel" if prefill_kernel_available() else "torch"
    loops = "AVX-512" if avx512 else "plain loops: this CPU has no AVX-512"
    q4 = "C kernel" if q4_available() else "refused (no AVX-512 BF16)"
    return (f"CPU paths: bf16 linears on {bf16}; w8a8_int8 {int8}; gguf Q4_1 {q4}; prefill attention on {prefill}; "
            f"norms, rotary and decode attention in C ({loops})")


def prefill_attention_applies(q: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `prefill_attention` runs here: bf16 on a CPU with AMX or AVX-512 BF16, head size 64 or 128."""
    return head_dim in (64, 128) and num_heads % num_kv_heads == 0 and usable(q) and prefill_kernel_available()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: Sequence[int], scale: float,
                      prefix_lens: Sequence[int] | None = None) -> torch.Tensor:
    """Causal attention of requests' new tokens packed one after another: q [new tokens, heads, d];
    k/v [keys, kv_heads, d] hold each request's prefix_lens[i] cached keys then its lens[i] new ones
    (no prefixes: k/v are the new tokens' own). Rows may be strided (heads and d contiguous).
    Returns [new tokens, heads * d]. On AMX tiles or AVX-512 BF16 (cpu_prefill_attention.c); check
    `prefill_attention_applies` first."""
    lib = kernels()
    n, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    prefixes = torch.tensor(list(prefix_lens) if prefix_lens is not None else [0] * len(lens), dtype=torch.int64)
    lens_t = torch.tensor(list(lens), dtype=torch.int64)
    keys = lens_t + prefixes  # per request
    assert lib is not None and int(lens_t.sum()) == n and d in (64, 128) and len(prefixes) == len(lens_t)
    for t, rows in ((q, n), (k, int(keys.sum())), (v, int(keys.sum()))):
        assert t.dtype == torch.bfloat16 and t.stride(2) == 1 and t.stride(1) == d and t.shape[0] == rows
    starts = torch.cumsum(lens_t, 0) - lens_t
    kstarts = torch.cumsum(keys, 0) - keys
    out = torch.empty(n, num_heads * d, dtype=torch.bfloat16)
    lib.srt_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                              out.data_ptr(), starts.data_ptr(), kstarts.data_ptr(), lens_t.data_ptr(),
                              prefixes.data_ptr(), len(lens), num_heads, num_kv_heads, d, scale)
    return out


def store_kv_applies(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     loc: torch.Tensor) -> bool:
    """Whether store_kv takes these: bf16 [n, kv heads, d] rows with each row's values contiguous
    (column slices of a qkv output are), contiguous caches of the same width, int64 slots."""
    return (usable(k, v, k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and loc.dtype == torch.int64 and loc.is_contiguous() and k.shape == v.shape
            and k.shape[1:] == k_cache.shape[1:] == v_cache.shape[1:]
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k_cache[loc] = k and v_cache[loc] = v (see store_kv_applies), rows copied in parallel."""
    lib = kernels()
    assert lib is not None
    n, width = k.shape[0], k.shape[1] * k.shape[2]
    lib.srt_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                     loc.data_ptr(), n, width)


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """logits.argmax(-1) for [rows, n] float32 CPU logits (None where the kernel does not apply)."""
    lib = kernels()
    if lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 \
            or not logits.is_contiguous():
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.srt_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., k] with at most GEMV_MAX_ROWS rows, weight [n, k] -> x @ weight.T (+ bias), bf16."""
    lib = kernels()
    k = x.shape[-1]
    m = x.numel() // k
    assert lib is not None and 1 <= m <= GEMV_MAX_ROWS and x.is_contiguous() and weight.is_contiguous()
    n = weight.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    lib.srt_gemv(x.data_ptr(), m, weight.data_ptr(), _p(bias), out.data_ptr(), n, k)
    return out
