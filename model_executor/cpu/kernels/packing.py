"""Weights in the layouts the linear kernels stream them in, packed once at load, and the GGUF
blocks (Q4_1, Q4_K, Q5_K, Q8_0, Q5_0, Q4_0, Q6_K) recovered from a dequantized float32 weight.

bf16_pack: bf16 for srt_bf16_linear; int8_pack -> Int8Weight for srt_int8_linear; q4_recover +
q4_pack -> Q4Weight for srt_q4_linear; q4k_recover + q4ks_pack (or q4_pack) -> Q4KWeight for
srt_q4ks_linear (srt_q4k_linear);
q5k_recover + q5k_pack -> Q5KWeight for srt_q5k_linear; q8_recover + q8_pack -> Q8Weight for
srt_q8_linear; q6k_recover + q6ks_pack (or q8_pack) -> Q8Weight for srt_q6ks_linear (srt_q6k_linear). Each layout is drawn in the .c
file that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_executor.cpu.kernels import build


def bf16_packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == 0 and k % 32 == 0


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] bf16 -> the order srt_bf16_linear streams it in: [n/16, k/32, 16 (k pairs), 16 (n), 2]
    (an AMX B tile per 32-wide slice of k; one vdpbf16ps operand per k pair)."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


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
    if not build.amx_available():
        q = (q.to(torch.int16) + 128).to(torch.uint8)
    return Int8Weight(
        q.view(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous(), scale.contiguous()
    )


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


Q4K_BLOCK_BYTES = 384  # cpu_q4_linear.c's srt_q4k_linear: the same with fp32 d and m


def _round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (float64) rounded to `bits` significant bits, as float32."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**bits), exponent - bits).float()


def _k_recover(weight: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q4k_recover (top 15) or q5k_recover (top 31): the runs' q in 0..top."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32 or not torch.isfinite(weight).all():
        return None
    w = weight.detach().view(n, k // 32, 32)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    gaps = w.sort(-1).values.diff(dim=-1)
    step = torch.where(gaps > 0, gaps, torch.inf).amin(-1, keepdim=True)
    spans = torch.where(high > low, ((high - low) / step).round().clamp(1, top), 1.0)
    estimate = _round_bits((high.double() - low.double()) / spans.double(), 17)
    unit = torch.ldexp(torch.ones_like(estimate), torch.frexp(estimate)[1] - 17)
    found = high == low  # a constant run: d = 0, q = 0
    d, q = torch.zeros_like(low), torch.zeros_like(w)
    for shift in (0, -1, 1, -2, 2):
        candidate = torch.where(high > low, estimate + shift * unit, 0.0)
        safe = torch.where(candidate > 0, candidate, 1.0)
        qc = torch.where(candidate > 0, torch.round((w - low) / safe), 0.0).clamp(0, top)
        ok = (candidate * qc + low == w).all(-1, keepdim=True) & ~found
        d, q, found = torch.where(ok, candidate, d), torch.where(ok, qc, q), found | ok
    if not found.all():
        return None
    return q.to(torch.uint8).view(n, k), d[..., 0], low[..., 0]


def q4k_recover(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The GGUF Q4_K sub-blocks behind a float32 [n, k] weight, if it is one: (q [n, k] uint8 in
    0..15, d [n, k/32] and m [n, k/32] float32) with float32(d * q + m) equal to every value; None
    where some 32-value run along k is no such block. gguf-py dequantizes a sub-block as
    (d sc) q - dmin mn in float32: d sc and dmin mn (fp16 times a 6-bit integer) are exact, 17
    significant bits at most, and so is each (d sc) q, so one rounding makes each value. Here m is
    the run's smallest value (its q is 0 in all but ~1e-4 of Gemma-3's sub-blocks, and the check
    takes any other that reproduces every value) and d the smallest gap between its values times
    the whole number of gaps in its range, rounded to 17 bits (or 1 or 2 such units off); every
    value is checked."""
    return _k_recover(weight, 15)


def q5k_recover(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The GGUF Q5_K sub-blocks behind a float32 [n, k] weight, as q4k_recover finds Q4_K's: gguf-py
    dequantizes them the same way, (d sc) q - dmin mn, with q in 0..31 (its 5 bits keep (d sc) q
    within 22 significant bits, still exact). A Q4_K weight is one too (q within 0..15): try
    q4k_recover first."""
    return _k_recover(weight, 31)


def q4_pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (q4_recover's form) -> srt_q4_linear's order, [n/16, k/32, 320] uint8: per 16
    outputs and 32 k, 16 d and 16 m (fp16), then for each quad of k 32 bytes: byte 2j q[j][4c] |
    q[j][4c + 2] << 4, byte 2j + 1 q[j][4c + 1] | q[j][4c + 3] << 4. n % 16 == 0. Q4_K blocks
    (q4k_recover's, d and m float32) -> srt_q4k_linear's [n/16, k/32, 384], the same with fp32 d, m."""
    n, k = q.shape
    blocks = k // 32
    scales = torch.stack([d, m], dim=1).view(n // 16, 16, 2, blocks).permute(0, 3, 2, 1)  # [n/16, kb, 2, 16]
    scales = scales.contiguous().view(torch.uint8).reshape(n // 16, blocks, -1)
    return torch.cat([scales, _nibbles(q)], dim=-1).contiguous()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [n, k] in 0..15 -> q4_pack's nibbles, [n/16, k/32, 256] uint8."""
    n, k = q.shape
    quads = q.view(n // 16, 16, k // 32, 8, 2, 2).permute(
        0, 2, 3, 1, 5, 4
    )  # [n/16, kb, c, j, pair, low/high]
    return (quads[..., 0] | (quads[..., 1] << 4)).reshape(n // 16, k // 32, 256)


Q4KS_BLOCK_BYTES = 304  # cpu_q4_linear.c's srt_q4ks_linear: Q4_K with six-bit scales, 2432 bytes a 256 k


def _int_factors(v: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """v [g, r] float32 -> (s [g, 1] float32, i [g, r] int in low..high) with float32(s i) equal to
    each value, or None where some group has no such factors. A K-quant super-block's sub-block
    scales are so, s being the file's fp16 d: Q4_K's d sc and -dmin mn (i in 0..63), Q6_K's d sc (i
    in -128..127). Each group's value of largest magnitude over a candidate i (the largest
    magnitudes first: llama.cpp's quantizers give that value 63, or -128) is tried as s until every
    i = round(v / s) is in range and reproduces its value exactly."""
    peak = v.gather(-1, v.abs().argmax(-1, keepdim=True))
    s, i = torch.zeros_like(peak), torch.zeros_like(v)
    todo = (peak != 0).squeeze(-1).nonzero().squeeze(-1)  # a group of zeros: s = 0, i = 0
    for top in sorted((t for t in range(low, high + 1) if t), key=lambda t: (-abs(t), t)):
        if not todo.numel():
            break
        vt, candidate = v[todo], peak[todo] / top
        ic = torch.round(vt / candidate)
        ok = ((ic >= low) & (ic <= high) & (candidate * ic == vt)).all(-1)
        s[todo[ok]], i[todo[ok]] = candidate[ok], ic[ok]
        todo = todo[~ok]
    return None if todo.numel() else (s, i)


def q4ks_pack(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, factors: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor | None:
    """Q4_K blocks (float32 d and m per run of 32) -> srt_q4ks_linear's order, or None where they
    are not a file's super-blocks (k % 256, or some eight runs' d or m without six-bit factors,
    _int_factors). Per 16 outputs and 256 k, 2432 bytes: the 16 outputs' fp32 D, then their
    fp32 M, then for each run of 32 k the 16 six-bit sc (uint8), the 16 mn, and q4_pack's 256 bytes
    of nibbles; the run's d is D sc and its m M mn, both exact (the same products as the file's).
    0.59 bytes a weight against q4_pack's 0.75; viewed as [n/16, k/32, 304]. n % 16 == 0. `factors`: the file's (D, sc, M, mn) where known
    (loader/gguf_blocks.py), found otherwise."""
    n, k = q.shape
    if k % 256:
        return None
    supers = k // 256
    d_factors: tuple[torch.Tensor, torch.Tensor] | None
    m_factors: tuple[torch.Tensor, torch.Tensor] | None
    if factors is not None:
        d_factors = (factors[0].reshape(n * supers, 1), factors[1].reshape(n * supers, 8))
        m_factors = (factors[2].reshape(n * supers, 1), factors[3].reshape(n * supers, 8))
    else:
        d_factors, m_factors = (_int_factors(v.reshape(n * supers, 8), 0, 63) for v in (d, m))
    if d_factors is None or m_factors is None:
        return None
    (big_d, sc), (big_m, mn) = d_factors, m_factors
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    head = torch.stack([big_d.view(n, supers), big_m.view(n, supers)], dim=1)  # [n, 2, supers]
    head = head.view(n // 16, 16, 2, supers).permute(0, 3, 2, 1).contiguous()  # [n/16, supers, 2, 16]
    head = head.view(torch.uint8).reshape(n // 16, supers, 128)
    six = torch.stack([sc.view(n, supers, 8), mn.view(n, supers, 8)], dim=1)  # [n, 2, supers, 8]
    six = six.view(n // 16, 16, 2, supers, 8).permute(0, 3, 4, 2, 1).reshape(n // 16, supers, 8, 32)
    runs = torch.cat([six, _nibbles(q).view(n // 16, supers, 8, 256)], dim=-1).reshape(n // 16, supers, 2304)
    return torch.cat([head, runs], dim=-1).contiguous().view(n // 16, k // 32, Q4KS_BLOCK_BYTES)


Q5K_BLOCK_BYTES = 448  # cpu_q4_linear.c's srt_q5k_linear: Q4_K's 384 bytes, then 64 of the q's fifth bits


def q5k_pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks (q5k_recover's) -> srt_q5k_linear's order, [n/16, k/32, 448] uint8: q4_pack's 384
    bytes of the low four bits, then per quad c of k two 32-bit words of fifth bits, word p holding
    those of q[j][4c + 2p] at bit (4 + j) % 32 and of q[j][4c + 2p + 1] at bit (20 + j) % 32: rotated
    right by j, output j's two sit at bits 4 and 20, over its lane of the chunk. n % 16 == 0."""
    n, k = q.shape
    blocks = k // 32
    high = (q >> 4).view(n // 16, 16, blocks, 8, 2, 2).permute(0, 2, 3, 4, 5, 1).long()  # [.., c, p, i, j]
    j, i = torch.arange(16), torch.arange(2)[:, None]
    words = (high << (4 + j + 16 * i) % 32).sum((-2, -1))  # [n/16, kb, c, p], 32 bits each
    fifths = words.view(torch.uint8).view(n // 16, blocks, 16, 8)[..., :4]  # little-endian: the low 4 bytes
    return torch.cat([q4_pack(q & 15, d, m), fifths.reshape(n // 16, blocks, 64)], dim=-1).contiguous()


@dataclass(frozen=True)
class Q4Weight:
    """A layer's GGUF Q4_1 weight for srt_q4_linear (decode steps of up to Q4_MAX_ROWS rows) and
    for more rows (a prefill, a big decode batch) srt_gguf_linear on the same blocks, or where that does
    not run, its bf16 copy packed for srt_bf16_linear."""

    packed: torch.Tensor  # q4_pack's [n/16, k/32, 320]
    bf16: torch.Tensor | None  # bf16_pack's; None where srt_gguf_linear takes every row count


@dataclass(frozen=True)
class Q4KWeight:
    """A layer's GGUF Q4_K weight for srt_q4k_linear (decode steps of up to Q4_MAX_ROWS rows) and
    for more rows srt_gguf_linear (or a bf16 copy, as Q4Weight's). Not a Q4Weight: its blocks are Q4_K's
    (srt_decode_layer tells the two apart by its `kinds`)."""

    packed: (
        torch.Tensor
    )  # q4ks_pack's [n/16, k/32, 304] where its scales are a file's, else q4_pack's [.., 384]
    bf16: torch.Tensor | None  # bf16_pack's; None where srt_gguf_linear takes every row count


@dataclass(frozen=True)
class Q5KWeight:
    """A layer's GGUF Q5_K weight for srt_q5k_linear (decode steps of up to Q5K_MAX_ROWS rows) and
    for more rows srt_gguf_linear (or a bf16 copy, as Q4Weight's)."""

    packed: torch.Tensor  # q5k_pack's [n/16, k/32, 448]
    bf16: torch.Tensor | None  # bf16_pack's; None where srt_gguf_linear takes every row count


Q8_BLOCK_BYTES = 544  # cpu_q8_linear.c: 16 outputs x 32 k of Q8_0 (fp16 d, then q + 128)


def q8_recover(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GGUF blocks of 32 values with one fp16 scale behind a float32 [n, k] weight, if it is
    such: (q [n, k] int8, d [n, k/32] fp16) with float32(d * q) equal to every value; None where
    some run of 32 along k is no such block. Q8_0 (q in -127..127, d the run's largest magnitude /
    127, as llama.cpp's quantizer sets it), Q5_0 (q - 16 in -16..15, d = its largest-magnitude
    value / -16) and Q4_0 (q - 8 in -8..7, d = that value / -8) all dequantize so, and all run on
    srt_q8_linear; a run may be any of the three. Every value is checked."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32 or not torch.isfinite(weight).all():
        return None
    w = weight.detach().view(n, k // 32, 32)
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)  # the largest-magnitude value
    d = torch.zeros(n, k // 32, dtype=torch.float16)
    q = torch.zeros_like(w)
    found = torch.zeros(n, k // 32, dtype=torch.bool)
    for scale, low, high in ((w.abs().amax(-1) / 127, -127, 127), (peak / -16, -16, 15), (peak / -8, -8, 7)):
        candidate = scale.half()
        if not torch.isfinite(candidate).all():
            continue
        df = candidate.float()[..., None]
        qc = torch.where(df != 0, torch.round(w / torch.where(df != 0, df, 1.0)), 0.0)
        ok = ~found & ((qc >= low) & (qc <= high) & (df * qc == w)).all(-1)
        d = torch.where(ok, candidate, d)
        q = torch.where(ok[..., None], qc, q)
        found |= ok
    if not found.all():
        return None
    return q.to(torch.int8).view(n, k), d


Q6K_BLOCK_BYTES = 640  # cpu_q8_linear.c's srt_q6k_linear: 16 outputs x 32 k, fp32 D per 16 k, then q + 128


def _q6k_runs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q6k_recover on runs of 16 ([runs, 16] float32): (q [runs, 16], D [runs, 1]) or None."""
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # [runs, 1]
    d, q = torch.zeros_like(peak), torch.zeros_like(w)
    todo = (peak != 0).squeeze(-1).nonzero().squeeze(-1)  # the runs not found yet; zeros are: D = 0
    for size in range(32, 0, -1):
        for q_peak in (-size, size) if size < 32 else (-size,):  # q in -32..31
            if not todo.numel():
                return q, d
            wt = w[todo]
            candidate = _round_bits(peak[todo].double() / q_peak, 19)  # never 0: the peak is not
            qc = torch.round(wt / candidate)
            ok = ((qc >= -32) & (qc <= 31) & (candidate * qc == wt)).all(-1)
            d[todo[ok]], q[todo[ok]] = candidate[ok], qc[ok]
            todo = todo[~ok]
    return None if todo.numel() else (q, d)


def q6k_recover(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GGUF Q6_K blocks behind a float32 [n, k] weight, if it is one: (q [n, k] int8 in
    -32..31, D [n, k/16] float32) with float32(D * q) equal to every value; None where some run of
    16 along k is no such block (or k % 32 != 0, which the kernel needs). gguf-py dequantizes a run
    as (d sc) q in float32: d sc (an fp16 times an int8) is exact, 18 significant bits at most, and
    so is its product with q (5 more bits at most, within fp32's 24). So for the right q_p, the
    run's largest-magnitude value w_p over q_p is D, on the 19-bit grid the candidates are rounded
    to; each value is still checked as float32(D q), as gguf-py computes it. Each run tries q_p =
    -32, -31, 31, -30, 30, .. (D of either sign) until a D gives every q = round(w / D) in -32..31
    with float32(D q) equal to its value; llama.cpp's quantizer gives the peak a q near -32, so most
    runs stop at the first tries. A run of zeros has D = 0. The first 1024 runs are tried alone
    first, so a weight of another type is refused before the tries run over all of it."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % 32 or not torch.isfinite(weight).all():
        return None
    w = weight.detach().reshape(-1, 16)
    head = _q6k_runs(w[:1024])
    rest = _q6k_runs(w[1024:]) if head is not None else None
    if head is None or rest is None:
        return None
    q, d = (torch.cat(parts) for parts in zip(head, rest))
    return q.to(torch.int8).view(n, k), d.view(n, k // 16)


def q8_pack(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (q8_recover's form) -> srt_q8_linear's order, [n/16, k/32, 544] uint8: per 16
    outputs and 32 k, the 16 d (fp16), then for each quad c of k 64 bytes, byte 4j + i being
    q[j][4c + i] + 128. n % 16 == 0. Q6_K blocks (q6k_recover's, D [n, k/16] float32) ->
    srt_q6k_linear's [n/16, k/32, 640]: the 16 outputs' D for k 0..15, then for k 16..31 (fp32),
    then the same 512 bytes."""
    n, k = q.shape
    blocks = k // 32
    halves = 2 if d.dtype == torch.float32 else 1  # Q6_K: a scale per 16 k
    scales = (
        d.view(n // 16, 16, blocks, halves)
        .permute(0, 2, 3, 1)
        .contiguous()
        .view(torch.uint8)
        .reshape(n // 16, blocks, -1)
    )
    biased = (q.to(torch.int16) + 128).to(torch.uint8).view(n // 16, 16, blocks, 8, 4)
    return torch.cat(
        [scales, biased.permute(0, 2, 3, 1, 4).reshape(n // 16, blocks, 512)], dim=-1
    ).contiguous()


Q6KS_BLOCK_BYTES = 424  # cpu_q8_linear.c's srt_q6ks_linear: Q6_K with int8 scales, 3392 bytes a 256 k


def q6ks_pack(
    q: torch.Tensor, d: torch.Tensor, factors: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor | None:
    """Q6_K blocks (q6k_recover's: q in -32..31, D float32 per run of 16) -> srt_q6ks_linear's
    order, or None where they are not a file's super-blocks (k % 256, or some 16 runs' D without an
    fp32 and int8 factors, _int_factors) or this CPU has no such kernel. Per 16 outputs and 256 k,
    3392 bytes: the 16 outputs' fp32 D, then for each run of 32 k the int8 sc of its k 0..15 and
    then 16..31 (16 each), and 8 chunks of 48 bytes, chunk c holding k 4c .. 4c + 3 as q8_pack's 64
    bytes L[4j + i] = q[j][4c + i] + 32 (six bits) would: 32 bytes L[b] & 15 | (L[b + 32] & 15) << 4,
    then 16 bytes of the top two bits, L[b] >> 4 | L[b + 16] >> 4 << 2 | L[b + 32] >> 4 << 4 |
    L[b + 48] >> 4 << 6. A run's D is D sc, exact. 0.83 bytes a weight against q8_pack's 1.25;
    viewed as [n/16, k/32, 424]. n % 16 == 0. `factors`: the file's (D, sc) where known
    (loader/gguf_blocks.py), found otherwise."""
    n, k = q.shape
    if k % 256 or not build.q6ks_available():
        return None
    supers = k // 256
    found: tuple[torch.Tensor, torch.Tensor] | None
    if factors is not None:  # a file's Q6_K: q in -32..31
        found = (factors[0].reshape(n * supers, 1), factors[1].reshape(n * supers, 16))
    elif int(q.min()) < -32 or int(q.max()) > 31:  # Q8_0 parts widened
        return None
    else:
        found = _int_factors(d.reshape(n * supers, 16), -128, 127)
    if found is None:
        return None
    big_d, sc = found
    head = (
        big_d.view(n // 16, 16, supers).permute(0, 2, 1).contiguous().view(torch.uint8)
    )  # [n/16, supers, 64]
    scales = sc.to(torch.int8).view(n // 16, 16, supers, 8, 2).permute(0, 2, 3, 4, 1)  # [.., run, half, j]
    scales = scales.contiguous().view(torch.uint8).reshape(n // 16, supers, 8, 32)
    lanes = (
        (q.to(torch.int16) + 32).to(torch.uint8).view(n // 16, 16, supers, 8, 8, 4)
    )  # [.., j, s, run, c, i]
    lanes = lanes.permute(0, 2, 3, 4, 1, 5).reshape(n // 16, supers, 8, 8, 64)  # L[4j + i] per chunk
    low, top = lanes & 15, lanes >> 4
    nibbles = low[..., :32] | (low[..., 32:] << 4)
    bits = top[..., :16] | (top[..., 16:32] << 2) | (top[..., 32:48] << 4) | (top[..., 48:] << 6)
    chunks = torch.cat([nibbles, bits], dim=-1).reshape(n // 16, supers, 8, 384)
    runs = torch.cat([scales, chunks], dim=-1).reshape(n // 16, supers, 8 * 416)
    return torch.cat([head, runs], dim=-1).contiguous().view(n // 16, k // 32, Q6KS_BLOCK_BYTES)


@dataclass(frozen=True)
class Q8Weight:
    """A GGUF weight of Q8_0, Q5_0 or Q4_0 blocks (a layer's, or the tied LM head's) for
    srt_q8_linear, or of Q6_K blocks for srt_q6k_linear (up to ops.q8_max_rows rows); for more rows
    srt_gguf_linear (or a bf16 copy, as Q4Weight's)."""

    packed: torch.Tensor  # q8_pack's [n/16, k/32, 544], or 640 for Q6_K (q6ks_pack's 424 where it takes them)
    bf16: torch.Tensor | None  # bf16_pack's; None where srt_gguf_linear takes every row count


GgufWeight = Q4Weight | Q4KWeight | Q5KWeight | Q8Weight

_Q4_K, _Q6_K = 12, 14  # ggml's type numbers (gguf.GGMLQuantizationType)


def file_rows_pack(ggml_type: int, raw: torch.Tensor, n: int, k: int) -> GgufWeight | None:
    """A file's Q4_K or Q6_K super-blocks (raw [n, k / 256 * bytes a block] uint8, as the file holds
    them) in q4ks_pack's or q6ks_pack's layout, laid out in C straight from the file's bytes
    (gguf_repack.c): a Q4KWeight or a Q8Weight for every row count (srt_gguf_linear). None where
    the type is another, the kernels or srt_gguf_linear do not run here, or n % 16 or k % 256."""
    lib = build.kernels()
    if lib is None or not build.gguf_linear_available() or n % 16 or k % 256:
        return None
    if ggml_type == _Q4_K and build.q4k_available():
        out, fn, size = (
            torch.empty(n // 16, k // 32, Q4KS_BLOCK_BYTES, dtype=torch.uint8),
            lib.srt_pack_q4k_file,
            144,
        )
    elif ggml_type == _Q6_K and build.q6ks_available():
        out, fn, size = (
            torch.empty(n // 16, k // 32, Q6KS_BLOCK_BYTES, dtype=torch.uint8),
            lib.srt_pack_q6k_file,
            210,
        )
    else:
        return None
    raw = raw.contiguous()
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (n, k // 256 * size), (raw.dtype, raw.shape)
    fn(raw.data_ptr(), n, k, out.data_ptr())
    return Q4KWeight(out, None) if ggml_type == _Q4_K else Q8Weight(out, None)


@dataclass(frozen=True)
class SplitWeight:
    """A merged weight whose parts the file holds in block types no one layout takes: llama.cpp's
    Q4_K_M keeps a qkv_proj's v in Q6_K beside Q4_K q and k in half the layers. Each run of rows
    on its own blocks' kernel, the outputs side by side."""

    parts: tuple[GgufWeight, ...]
    rows: tuple[int, ...]  # each part's output rows, in order
