"""The fused CPU kernels (model_executor/cpu/kernels) against the torch ops they replace, and a bf16
model with them against the same model on torch ops, both measured against fp32 transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import hf_float32, hf_forced_logits, make_tiny_model

from model_executor.cpu.attention_backend import CpuKernelsAttnBackend
from model_executor.cpu.kernels import build, decode_layers, ops
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(
    build._compiler() is None or build.kernel_isa() == "none",
    reason="no C compiler, or SRT_CPU_KERNEL_ISA=none: the kernels are not built",
)


def test_kernels_build_where_there_is_a_compiler() -> None:
    assert build.kernels() is not None  # a build error must fail here, not skip every test below


def test_the_start_up_line_names_each_kernels_path_on_this_cpu() -> None:
    line = build.describe_paths()
    assert f"bf16 linears on {build.bf16_linear_isa() or 'torch'}" in line, line
    assert ("refused (no VNNI)" in line) != build.int8_available(), line
    assert ("plain loops: this CPU has no AVX-512" in line) == (
        "avx512f" not in build._cpu_flags().split() or build.kernel_isa() == "avx2"
    ), line
    off = subprocess.run(
        [sys.executable, "-c", "from model_executor.cpu.kernels import build; print(build.describe_paths())"],
        env={**os.environ, "SRT_CPU_KERNELS": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "every op runs on torch" in off.stdout, off


def test_every_kernel_is_declared_once_in_the_header_and_typed_from_it() -> None:
    """srt_kernels.h is the one interface: each .c file includes it and declares nothing itself,
    every exported function is declared there, and the loaded functions carry its signatures."""
    declared = build.signatures(build.HEADER.read_text())
    defined = set()
    for source in build.SOURCES:
        text = source.read_text()
        assert '#include "srt_kernels.h"' in text and "typedef uint16_t bf16" not in text, source.name
        assert not re.search(r"^(void|int64_t)\s+srt_\w+\([^)]*\);", text, re.M), (
            f"{source.name} declares its own"
        )
        defined |= set(re.findall(r"^(?:void|int64_t)\s+(srt_\w+)\(", text, re.M))
    assert defined == set(declared)
    assert len(declared["srt_decode_layer"][1]) == 54  # the 54-argument fused layer, read from the header
    lib = build.kernels()
    assert lib is not None
    for name, (restype, argtypes) in declared.items():
        assert getattr(lib, name).argtypes == argtypes and getattr(lib, name).restype == restype, name
    with pytest.raises(TypeError):  # a call with an argument missing never reaches the C code
        lib.srt_silu_mul(0, 0, 4)


@pytest.mark.parametrize(
    "header",
    [
        "void srt_f(bf16 x);",
        "double srt_f(void);",
        "void srt_f(int64_t);",
        "void srt_f(int64_t n)",
        "int64_t srt_f(void); void srt_f(void);",
    ],
)
def test_a_header_ctypes_cannot_read_fails_loudly(header: str) -> None:
    with pytest.raises(ValueError, match="srt_kernels.h"):
        build.signatures(header)


@pytest.mark.parametrize(
    "definition",
    [
        "void srt_silu_mul(const bf16 *x, bf16 *out, int64_t rows) {}",  # a parameter fewer than declared
        "void srt_silu_mul(const bf16 *x, bf16 *out, int64_t rows, float d) {}",  # a kind other than declared
        "void srt_undeclared(void) {}",  # exported without a declaration in the header
    ],
)
def test_a_definition_that_disagrees_with_the_header_does_not_build(definition: str, tmp_path: Path) -> None:
    cc = build._compiler()
    assert cc is not None
    source = tmp_path / "wrong.c"
    source.write_text(f'#include "{build.HEADER}"\n{definition}\n')
    with pytest.raises(RuntimeError, match="failed"):
        build.compile_shared_object(cc, [source], tmp_path / "wrong.so")
    source.write_text(
        f'#include "{build.HEADER}"\nvoid srt_silu_mul(const bf16 *x, bf16 *out, int64_t rows, '
        "int64_t d) {}\n"
    )
    build.compile_shared_object(cc, [source], tmp_path / "right.so")  # the declared form builds


def test_ops_name_the_argument_they_refuse() -> None:
    x = torch.zeros(4, 64, dtype=BF16)
    with pytest.raises(ValueError, match="^x must be contiguous"):
        ops.silu_mul(x.t())
    with pytest.raises(ValueError, match="^x must have 1 to 4 rows; got 5"):
        ops.gemv(torch.zeros(5, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16), None)
    with pytest.raises(ValueError, match="^out_dtype must be torch.bfloat16 or torch.float32"):
        ops.bf16_linear(x, torch.zeros(2, 2, 16, 16, 2, dtype=BF16), None, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="^positions must be torch.int64"):
        ops.rope(x.view(4, 1, 64), torch.zeros(4, dtype=torch.int32), x, x)
    q, cache, slots = (
        torch.zeros(2, 64, dtype=BF16),
        torch.zeros(8, 64, dtype=BF16),
        torch.zeros(2, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="^seq_lens must be 2 contiguous int64 values"):
        ops.decode_attention(
            q,
            q,
            q,
            cache,
            cache,
            slots,
            torch.zeros(2, 8, dtype=torch.int64),
            slots,
            slots.int(),
            8,
            1,
            1,
            64,
            0.125,
        )
    with pytest.raises(ValueError, match="^lens must sum to q's 4 rows; got 3"):
        ops.prefill_attention(x.view(4, 1, 64), x.view(4, 1, 64), x.view(4, 1, 64), [3], 0.125)


BF16 = torch.bfloat16


def rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0) -> None:
    """Within a few bf16 rounding steps (2^-8 relative each) of the reference's magnitude."""
    bound = ulps * 2.0**-8 * want.float().abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= bound, f"max diff {diff} > {bound}"


# 576: whole 16-lane vectors; 40: a masked tail of 8 lanes; 4096 rows: the parallel loop
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 576), (64, 576), (3, 40), (4096, 576)])
def test_rmsnorm_with_and_without_residual(rows: int, dim: int) -> None:
    x, residual, weight = rand(rows, dim, seed=1), rand(rows, dim, seed=2), rand(dim, seed=3)
    out, none = ops.rmsnorm(x, weight, 1e-5)
    assert none is None
    assert_bf16_close(out, F.rms_norm(x.float(), (dim,), weight.float(), 1e-5))
    out, started = ops.rmsnorm(x, weight, 1e-5, keep_residual=True)  # a first layer starts the stream
    assert started is not None and started.dtype == torch.float32 and torch.equal(started, x.float())
    assert_bf16_close(out, F.rms_norm(x.float(), (dim,), weight.float(), 1e-5))
    stream = residual.float() + rand(rows, dim, seed=4).float() / 256  # a float32 stream, off the bf16 grid
    out, new_residual = ops.rmsnorm(x, weight, 1e-5, stream)
    # the sum is kept unrounded: float32, exactly torch's float32 add
    assert new_residual is not None and new_residual.dtype == torch.float32
    assert torch.equal(new_residual, x.float() + stream)
    assert not torch.equal(new_residual, new_residual.bfloat16().float())
    assert_bf16_close(out, F.rms_norm(new_residual, (dim,), weight.float(), 1e-5))
    # x float32 too: a row-parallel layer's output, its sums unrounded
    x32 = x.float() + rand(rows, dim, seed=5).float() / 512
    out, new_residual = ops.rmsnorm(x32, weight, 1e-5, stream)
    assert new_residual is not None and torch.equal(new_residual, x32 + stream)
    assert out.dtype == torch.bfloat16
    assert_bf16_close(out, F.rms_norm(x32 + stream, (dim,), weight.float(), 1e-5))
    with pytest.raises(ValueError, match="^residual must be torch.float32"):
        ops.rmsnorm(x, weight, 1e-5, residual)


# 384: all-MiniLM-L6-v2's width; 40: not a multiple of 16; 4096 rows: the parallel loop
@pytest.mark.parametrize(("rows", "dim"), [(1, 384), (25, 384), (3, 40), (4096, 384)])
def test_layernorm_is_torchs_in_float32_and_rounds_once(rows: int, dim: int) -> None:
    """BERT's post-norm: layernorm(x + residual) * weight + bias in float32, as torch's to a few
    float32 ulps, and the same rounded to bf16 (torch's cast of it, bit for bit)."""
    g = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    residual = torch.randn(rows, dim, generator=g) * 3 + 1  # a mean far from 0: the two passes matter
    for x in (rand(rows, dim, seed=8), torch.randn(rows, dim, generator=g)):  # bf16 or float32 x
        out, rounded = ops.layernorm(x, weight, bias, 1e-12, residual, with_bf16=True)
        want = F.layer_norm(residual + x.float(), (dim,), weight, bias, 1e-12)
        assert out.dtype == torch.float32 and (out - want).abs().max().item() < 1e-5 * want.abs().max().item()
        assert rounded is not None and torch.equal(rounded, out.bfloat16())
    out, none = ops.layernorm(residual, weight, bias, 1e-5)  # no residual, no bf16 copy
    assert none is None
    torch.testing.assert_close(out, F.layer_norm(residual, (dim,), weight, bias, 1e-5), rtol=0, atol=1e-5)


# 4608 and 38400: the MLP's 1536 wide rows of 3 and 25 tokens (the second on the parallel loop)
@pytest.mark.parametrize("n", [4608, 38400, 37])
def test_gelu_erf_is_the_exact_gelu_rounded_once(n: int) -> None:
    """srt_gelu_erf against GELU in float64 (x erfc(-x / sqrt 2) / 2, accurate in the negative tail
    too): within one bf16 rounding (2^-8 of the value) plus erfc's approximation error, relative
    everywhere; past x = -13 (exp's clamp) within 1e-36. Where torch's float32 gelu is accurate (x
    above -3) the two nearly always round to the same bf16."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(9)) * 4
    x[:6] = torch.tensor([-100.0, -10.0, 0.0, -0.0, 10.0, 100.0])  # the tails, both signs of 0
    got = ops.gelu_erf(x)
    x64 = x.double()
    want = x64 * torch.special.erfc(-x64 / 2**0.5) / 2
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * (2.0**-8 + 1e-6) + 1e-36).all()
    body = x > -3
    assert (got[body] != F.gelu(x[body]).bfloat16()).float().mean().item() < 0.01  # a few ties, no more


# MiniLM's 12 heads of 32 on one short and one long text; several requests of odd lengths (keys
# padded to blocks of 16, queries in groups of 4); heads of 24 and 40 (dims padded); one token alone
@pytest.mark.parametrize(
    ("lens", "heads", "d"),
    [([25], 12, 32), ([300], 12, 32), ([1, 17, 5, 40], 4, 64), ([9, 3], 3, 24), ([1], 2, 40)],
)
def test_encoder_attention_is_the_float32_softmax_rounded_once(lens: list[int], heads: int, d: int) -> None:
    """srt_encoder_attention against softmax(q k^T / sqrt d) v in float64, each request's tokens
    attending to all of its own (not another's): within one bf16 rounding plus float32's error, and
    nearly always the same bf16 as the float64 value rounded. q, k, v are strided views of one qkv
    row, as BERT's projection gives them."""
    n, width = sum(lens), heads * d
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(n, 3 * width + 5, generator=g) * 2  # 5 more columns: rows wider than q, k, v
    q, k, v = qkv[:, :width], qkv[:, width : 2 * width], qkv[:, 2 * width : 3 * width]
    got = ops.encoder_attention(q, k, v, lens, d, d**-0.5)
    want, start = [], 0
    for length in lens:
        qh, kh, vh = (
            t[start : start + length].double().unflatten(1, (heads, d)).transpose(0, 1) for t in (q, k, v)
        )
        scores = (qh @ kh.transpose(1, 2) * d**-0.5).softmax(-1)
        want.append((scores @ vh).transpose(0, 1).flatten(1))
        start += length
    expected = torch.cat(want)
    assert got.dtype == torch.bfloat16 and got.shape == (n, width)
    assert ((got.double() - expected).abs() <= expected.abs() * 2.0**-8 + 1e-5).all()
    assert (got != expected.bfloat16()).float().mean().item() < 0.01  # a few ties, no more


def test_encoder_attention_refuses_mismatched_arguments() -> None:
    qkv = torch.randn(6, 96)
    q, k, v = qkv[:, :32], qkv[:, 32:64], qkv[:, 64:]
    with pytest.raises(ValueError, match=r"lens \[2, 3\] must be positive and sum to 6"):
        ops.encoder_attention(q, k, v, [2, 3], 16, 0.25)
    with pytest.raises(ValueError, match="heads of 12 in 32"):
        ops.encoder_attention(q, k, v, [6], 12, 0.25)
    with pytest.raises(ValueError, match=r"v must be float32 \[6, 32\] rows of q's stride 96"):
        ops.encoder_attention(q, k, v.contiguous(), [6], 16, 0.25)


def test_bert_layer_refuses_mismatched_arguments() -> None:
    """The fused BERT layer (tests/test_embeddings.py checks its bits) checks what it is given."""
    h, hb = torch.zeros(5, 64), torch.zeros(5, 64, dtype=torch.bfloat16)
    lens, params, scratch = (
        torch.tensor([2, 3]),
        torch.zeros(12, dtype=torch.int64),
        ops.bert_layer_scratch(5, 64, 128),
    )
    with pytest.raises(ValueError, match=r"params hold 12 addresses \(got 11\)"):
        ops.bert_layer(h, hb, lens, params[:11], 1e-12, 16, 128, scratch)
    with pytest.raises(ValueError, match="lens sum to 5"):
        ops.bert_layer(h, hb, torch.tensor([4]), params, 1e-12, 16, 128, scratch)
    with pytest.raises(ValueError, match="scratch must be float32 of 2720 values"):
        ops.bert_layer(h, hb, lens, params, 1e-12, 16, 128, scratch[:100])
    with pytest.raises(ValueError, match="hb must be torch.bfloat16"):
        ops.bert_layer(h, h, lens, params, 1e-12, 16, 128, scratch)


@pytest.mark.parametrize(("rows", "d"), [(1, 1536), (33, 1536), (2, 20), (4096, 1536)])
def test_silu_mul(rows: int, d: int) -> None:
    x = rand(rows, 2 * d, seed=4, scale=4.0)
    x[0, :6] = torch.tensor([-100.0, -88.0, 0.0, 88.0, 100.0, -0.0])  # exp's clamps, both signs of 0
    gate, up = x.float().chunk(2, dim=-1)
    assert_bf16_close(ops.silu_mul(x), F.silu(gate) * up)


# d 64 and 128: AVX-512 with cos/sin rows widened once per token; 48: the plain loops
@pytest.mark.parametrize(("n", "d"), [(1, 64), (7, 64), (300, 64), (5, 128), (5, 48)])
def test_rope_on_strided_rows_matches_the_torch_rotation(n: int, d: int) -> None:
    rot = RotaryEmbedding(d, 1024, {"rope_theta": 10000.0, "rope_type": "default"}, torch.float32)
    qkv = rand(n, 15 * d, seed=5)
    x = qkv[:, : 12 * d].view(n, 12, d)  # q and k heads of a qkv row: a strided view
    positions = torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(6))
    want = rot.rotate(positions, x.float())  # fp32 tables and math
    got = ops.rope(x, positions, rot.cos.to(BF16), rot.sin.to(BF16))
    assert got.is_contiguous() and got.shape == x.shape
    assert_bf16_close(got, want, ulps=4.0)  # bf16 cos/sin tables add their own rounding


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (13, 40)])  # AVX-512 BF16 blocks, and the plain loop
def test_gemv_matches_fp32_matmul(m: int, n: int, k: int) -> None:
    x, weight, bias = rand(m, k, seed=12), rand(n, k, seed=13), rand(n, seed=14)
    want = x.float() @ weight.float().T + bias.float()
    assert_bf16_close(ops.gemv(x, weight, bias), want, ulps=3.0)
    assert_bf16_close(ops.gemv(x, weight, None), x.float() @ weight.float().T, ulps=3.0)


def paged_case(lens: list[int], hq: int, hkv: int, d: int = 64) -> dict[str, torch.Tensor]:
    """A pool whose requests own scattered slots, and one new token per request."""
    bs, slots = len(lens), sum(lens) + 7
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(slots, generator=g)
    req_to_token = torch.zeros(bs + 3, max(lens) + 4, dtype=torch.int64)
    rows = torch.arange(2, bs + 2)
    start = 0
    for row, n in zip(rows.tolist(), lens):
        req_to_token[row, :n] = order[start : start + n]
        start += n
    qkv = rand(bs, (hq + 2 * hkv) * d, seed=8)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    return {
        "q": qkv[:, : hq * d],
        "k": qkv[:, hq * d : (hq + hkv) * d],
        "v": qkv[:, (hq + hkv) * d :],
        "k_cache": rand(slots, hkv, d, seed=9),
        "v_cache": rand(slots, hkv, d, seed=10),
        "req_to_token": req_to_token,
        "rows": rows,
        "seq_lens": seq_lens,
        "out_loc": req_to_token[rows, seq_lens - 1].clone(),
    }


# Head sizes 64 and 128 with groups up to 8 take the AVX-512 BF16 path (vdpbf16ps scores, 16 tokens
# reduced together), others the generic one; 8 or more requests make a task of all of a request's
# kv heads, fewer a task per (request, kv head); on the fast path a request past 512 tokens is split
# into about equal tasks (at most 512 tokens, a multiple of the threads) whose partial sums are combined.
@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d"),
    [
        ([40], 9, 3, 64),
        ([1, 17, 130, 64], 9, 3, 64),
        ([5, 6], 4, 4, 64),
        ([9, 3], 8, 1, 64),
        ([33, 1, 16, 17, 2, 90, 5, 31, 64], 9, 3, 64),
        ([20, 47, 3, 8, 1, 15, 16, 32, 9], 8, 2, 128),
        ([7, 19], 16, 1, 64),
        ([12, 5], 4, 2, 32),
        ([1500], 9, 3, 64),
        ([513, 40, 1030], 8, 2, 128),
        ([600, 3, 512, 1, 70, 1025, 9, 33, 5], 9, 3, 64),
        ([700, 20], 4, 2, 32),
    ],
)
def test_decode_attention_writes_the_new_kv_and_matches_sdpa(
    lens: list[int], hq: int, hkv: int, d: int
) -> None:
    c = paged_case(lens, hq, hkv, d)
    scale = d**-0.5
    out = ops.decode_attention(
        c["q"],
        c["k"],
        c["v"],
        c["k_cache"],
        c["v_cache"],
        c["out_loc"],
        c["req_to_token"],
        c["rows"],
        c["seq_lens"],
        max(lens),
        hq,
        hkv,
        d,
        scale,
    )
    assert torch.equal(c["k_cache"][c["out_loc"]], c["k"].reshape(-1, hkv, d))
    assert torch.equal(c["v_cache"][c["out_loc"]], c["v"].reshape(-1, hkv, d))
    for b, n in enumerate(lens):
        slots = c["req_to_token"][c["rows"][b], :n]
        k = c["k_cache"][slots].float().transpose(0, 1)
        v = c["v_cache"][slots].float().transpose(0, 1)
        q = c["q"][b].float().view(hq, 1, d)
        want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv).reshape(-1)
        assert_bf16_close(out[b], want)


@pytest.mark.parametrize(
    ("lens", "window", "hq", "hkv", "d"),
    [
        ([40, 3, 16, 17], 16, 9, 3, 64),
        ([1500, 20, 513], 512, 8, 2, 128),  # a long request's window split into parts (fast path)
        ([700, 9], 600, 4, 2, 32),
        ([30, 31], 1, 4, 4, 64),
    ],
)
def test_decode_attention_attends_within_a_sliding_window(
    lens: list[int], window: int, hq: int, hkv: int, d: int
) -> None:
    """With a window each request attends over its last `window` keys only (its first keys are
    never read: they hold NaN here)."""
    c = paged_case(lens, hq, hkv, d)
    for b, n in enumerate(lens):
        if n > window:
            c["k_cache"][c["req_to_token"][c["rows"][b], : n - window]] = float("nan")
            c["v_cache"][c["req_to_token"][c["rows"][b], : n - window]] = float("nan")
    scale = d**-0.5
    args = (c["req_to_token"], c["rows"], c["seq_lens"], max(lens), hq, hkv, d, scale)
    out = ops.decode_attention(
        c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["out_loc"], *args, window=window
    )
    for b, n in enumerate(lens):
        slots = c["req_to_token"][c["rows"][b], max(0, n - window) : n]
        k = c["k_cache"][slots].float().transpose(0, 1)
        v = c["v_cache"][slots].float().transpose(0, 1)
        q = c["q"][b].float().view(hq, 1, d)
        want = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv).reshape(-1)
        assert_bf16_close(out[b], want)


def test_gelu_tanh_mul_is_torchs_gelu_times_up() -> None:
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 2 * 1000, generator=g) * 3).to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(
        ops.gelu_tanh_mul(x).float(), want.to(torch.bfloat16).float(), rtol=8e-3, atol=1e-5
    )


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_f32w_is_gemmas_norm(
    x_dtype: torch.dtype, out_dtype: torch.dtype, with_residual: bool
) -> None:
    """Gemma's norm with a float32 weight (1 + w): the float32 rms, times the weight unrounded, only
    the output rounded (to bf16 where asked); the residual sum kept in float32."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 640, generator=g) * 3).to(x_dtype)
    residual = torch.randn(7, 640, generator=g) if with_residual else None
    weight = 1 + torch.randn(640, generator=g) * 0.3
    out, new_residual = ops.rmsnorm_f32w(x, weight, 1e-6, out_dtype, residual)
    total = x.float() + (residual if residual is not None else 0)
    want = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert out.dtype == out_dtype
    torch.testing.assert_close(
        out.float(), want.to(out_dtype).float(), rtol=1e-5 if out_dtype == torch.float32 else 8e-3, atol=1e-5
    )
    if residual is not None:
        assert new_residual is not None and torch.equal(new_residual, total)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 64), (4, 1, 32)])
def test_decode_attention_soft_caps_the_scores(hq: int, hkv: int, d: int) -> None:
    """Gemma 2's capping: each scaled score s becomes cap * tanh(s / cap) before the softmax (on the
    generic loop, also where the AVX-512 BF16 one would take the shape)."""
    lens, cap, scale = [40, 3, 130], 0.5, d**-0.5
    c = paged_case(lens, hq, hkv, d)
    c["q"].mul_(8)  # scores well past the cap
    args = (c["req_to_token"], c["rows"], c["seq_lens"], max(lens), hq, hkv, d, scale)
    out = ops.decode_attention(
        c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["out_loc"], *args, softcap=cap
    )
    for b, n in enumerate(lens):
        slots = c["req_to_token"][c["rows"][b], :n]
        k = c["k_cache"][slots].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        v = c["v_cache"][slots].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        scores = c["q"][b].float().view(hq, 1, d) @ k.transpose(1, 2) * scale
        want = (torch.tanh(scores / cap) * cap).softmax(-1) @ v
        assert_bf16_close(out[b], want.reshape(-1))


def test_decode_attention_gives_a_request_the_same_bits_alone_and_in_a_batch() -> None:
    """The fast path's splits follow each request's own length, never the batch."""
    lens, hq, hkv, d = [1100, 20, 700, 513, 5, 64, 2048, 9, 300], 9, 3, 64
    c = paged_case(lens, hq, hkv, d)
    args = (c["k_cache"], c["v_cache"])
    together = ops.decode_attention(
        c["q"],
        c["k"],
        c["v"],
        *args,
        c["out_loc"],
        c["req_to_token"],
        c["rows"],
        c["seq_lens"],
        max(lens),
        hq,
        hkv,
        d,
        d**-0.5,
    )
    for b, n in enumerate(lens):
        one = slice(b, b + 1)
        alone = ops.decode_attention(
            c["q"][one],
            c["k"][one],
            c["v"][one],
            *args,
            c["out_loc"][one],
            c["req_to_token"],
            c["rows"][one],
            c["seq_lens"][one],
            n,
            hq,
            hkv,
            d,
            d**-0.5,
        )
        assert torch.equal(alone[0], together[b]), n


def test_decode_attention_splits_right_with_more_threads_than_512_token_parts() -> None:
    """16 threads: a multiple of 16 splits, capped at one per 64 tokens (600 tokens: 9; 1300: 16)."""
    lens, hq, hkv, d = [600, 1300], 9, 3, 64
    c = paged_case(lens, hq, hkv, d)
    threads = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        out = ops.decode_attention(
            c["q"],
            c["k"],
            c["v"],
            c["k_cache"],
            c["v_cache"],
            c["out_loc"],
            c["req_to_token"],
            c["rows"],
            c["seq_lens"],
            max(lens),
            hq,
            hkv,
            d,
            d**-0.5,
        )
    finally:
        torch.set_num_threads(threads)
    for b, n in enumerate(lens):
        slots = c["req_to_token"][c["rows"][b], :n]
        k, v = (c[name][slots].float().transpose(0, 1) for name in ("k_cache", "v_cache"))
        want = F.scaled_dot_product_attention(
            c["q"][b].float().view(hq, 1, d), k, v, scale=d**-0.5, enable_gqa=True
        ).reshape(-1)
        assert_bf16_close(out[b], want)


needs_prefill_kernel = pytest.mark.skipif(
    build._compiler() is None
    or not ops.prefill_attention_applies(torch.zeros(1, 1, 64, dtype=BF16), 1, 1, 64),
    reason="neither AMX nor AVX-512 BF16 here",
)


# Prompts packed one after another, ragged: partial 16-query blocks (AVX-512: 6-row tiles), a
# prompt past one 128-query task (AVX-512: 64), one token alone; grouped query heads 1, 3, 8.
@needs_prefill_kernel
@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d"),
    [
        ([128, 128, 128], 9, 3, 64),
        ([1, 17, 130, 64], 9, 3, 64),
        ([300], 8, 1, 64),
        ([5, 16, 33, 257], 4, 4, 128),
        ([40, 7], 16, 2, 128),
    ],
)
def test_prefill_attention_matches_causal_sdpa(lens: list[int], hq: int, hkv: int, d: int) -> None:
    n = sum(lens)
    qkv = rand(n, (hq + 2 * hkv) * d, seed=12)
    q = qkv[:, : hq * d].view(n, hq, d)  # strided rows, as the columns of one qkv tensor
    k, v = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d), qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    assert ops.prefill_attention_applies(q, hq, hkv, d)
    out = ops.prefill_attention(q, k, v, lens, d**-0.5)
    start = 0
    for length in lens:
        qi, ki, vi = (t[start : start + length].float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        want = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=d**-0.5, enable_gqa=hq != hkv)
        assert_bf16_close(out[start : start + length], want[0].transpose(0, 1).reshape(length, -1))
        start += length


# New tokens after cached prefixes (chunked prefill, prefix-cache hits): each request's keys are
# its prefix then its new tokens, packed.
@needs_prefill_kernel
@pytest.mark.parametrize(
    ("spec", "hq", "hkv", "d"),
    [([(0, 40), (17, 5), (128, 130), (3, 1)], 9, 3, 64), ([(300, 20), (1, 257)], 8, 2, 128)],
)
def test_prefill_attention_after_cached_prefixes_matches_masked_sdpa(
    spec: list[tuple[int, int]], hq: int, hkv: int, d: int
) -> None:
    prefixes, lens = [p for p, _ in spec], [n for _, n in spec]
    q = rand(sum(lens), hq, d, seed=14)
    k, v = rand(sum(prefixes) + sum(lens), hkv, d, seed=15), rand(sum(prefixes) + sum(lens), hkv, d, seed=16)
    out = ops.prefill_attention(q, k, v, lens, d**-0.5, prefixes)
    qs = ks = 0
    for prefix, new in spec:
        qi = q[qs : qs + new].float().transpose(0, 1).unsqueeze(0)
        ki, vi = (t[ks : ks + prefix + new].float().transpose(0, 1).unsqueeze(0) for t in (k, v))
        mask = torch.ones(new, prefix + new, dtype=torch.bool).tril(diagonal=prefix)
        want = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=d**-0.5, enable_gqa=hq != hkv)
        assert_bf16_close(out[qs : qs + new], want[0].transpose(0, 1).reshape(new, -1))
        qs, ks = qs + new, ks + prefix + new


@needs_prefill_kernel
def test_bf16_prefill_with_the_attention_kernel_is_as_accurate_as_sdpa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged prompts, prefilled fresh and then in two chunks (the second after its cached
    prefix): every layer's prefill attention is one kernel call, and the last tokens' logits are
    as close to fp32 transformers as with torch's SDPA."""
    model_dir = make_tiny_model("llama_d64", tmp_path / "llama_d64")
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 30, 140, 17)]
    hf = hf_float32(model_dir)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])

    def prefill(runner: ModelRunner, cut: int) -> torch.Tensor:
        """Tokens [0, cut) of every prompt, then the rest after them as a cached prefix (cut 0: one extend)."""
        rows = [int(runner.req_to_token_pool.alloc()) for _ in prompts]  # type: ignore[arg-type]
        logits = None
        for lo, hi in ((0, cut), (cut, None)) if cut else ((0, None),):
            parts = [p[lo:hi] for p in prompts]
            prefix, seq = [min(lo, len(p)) for p in prompts], [len(p[:hi]) for p in prompts]
            live = [i for i, part in enumerate(parts) if part]
            loc = runner.memory.alloc_extend(
                [rows[i] for i in live],
                [prefix[i] for i in live],
                [seq[i] for i in live],
            )
            logits = runner.forward(
                make_forward_batch(
                    ForwardMode.EXTEND,
                    [t for i in live for t in parts[i]],
                    [rows[i] for i in live],
                    [prefix[i] for i in live],
                    [seq[i] for i in live],
                    loc,
                )
            )
        assert logits is not None
        return logits

    calls: list[int] = []
    real = ops.prefill_attention
    monkeypatch.setattr(ops, "prefill_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    config = RunnerConfig(model_dir=model_dir, dtype=BF16, max_total_tokens=1024)
    layers = hf.config.num_hidden_layers
    fresh, chunked = (
        prefill(ModelRunner(config), 0),
        prefill(ModelRunner(config), 2),
    )  # prompt 3 keeps 1 token
    assert len(calls) == 3 * layers
    monkeypatch.setattr(ops, "prefill_attention_applies", lambda *a: False)
    fresh_sdpa, chunked_sdpa = prefill(ModelRunner(config), 0), prefill(ModelRunner(config), 2)
    assert len(calls) == 3 * layers
    for with_kernel, with_sdpa in ((fresh, fresh_sdpa), (chunked, chunked_sdpa)):
        err_kernel, err_sdpa = ((x - ref).abs().max().item() for x in (with_kernel, with_sdpa))
        assert err_kernel <= 1.5 * err_sdpa + 1e-3, (err_kernel, err_sdpa)


def decode_logits(runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """Prefill, then decode the `forced` tokens (teacher forcing); logits of every decode step,
    [steps, bs, vocab]. The requests have different lengths, so decode attention is ragged."""
    pool, _allocator = runner.req_to_token_pool, runner.allocator
    rows = [int(pool.alloc()) for _ in prompts]  # type: ignore[arg-type]
    lens = [len(p) for p in prompts]
    loc = runner.memory.alloc_extend(rows, [0] * len(rows), lens)
    runner.forward(
        make_forward_batch(
            ForwardMode.EXTEND, [t for p in prompts for t in p], rows, [0] * len(rows), lens, loc
        )
    )
    steps = []
    for step in range(len(forced[0])):
        prefix = [n + step for n in lens]
        seq = [n + 1 for n in prefix]
        loc = runner.memory.alloc_extend(rows, prefix, seq)
        batch = make_forward_batch(ForwardMode.DECODE, [f[step] for f in forced], rows, prefix, seq, loc)
        steps.append(runner.forward(batch))
    return torch.stack(steps)


@pytest.mark.parametrize(
    ("arch", "lens"),
    [("llama", (3, 30)), ("qwen2", (3, 30)), ("qwen3", (3, 30)), ("llama", (3, 30, 7, 19, 1))],
)
def test_bf16_model_with_kernels_is_as_accurate_as_torch_ops(
    arch: str, lens: tuple[int, ...], tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged batches: 2 rows (fused with the gemv kernel or packed weights), 5 rows (fused only with
    packed weights: AMX or AVX-512 BF16)."""
    model_dir = tiny_model_dirs[arch]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in lens]
    forced = [torch.randint(3, 320, (6,), generator=g).tolist() for _ in prompts]
    hf = hf_float32(model_dir)
    ref = hf_forced_logits(hf, prompts, forced)

    config = RunnerConfig(model_dir=model_dir, dtype=BF16, max_total_tokens=512)
    fused = ModelRunner(config)
    assert isinstance(fused.attn_backend, CpuKernelsAttnBackend) and fused.attn_backend.kernel_attention
    calls: dict[str, int] = {}
    for name in ("rmsnorm", "silu_mul", "bf16_linear_silu", "rope", "decode_attention"):
        real = getattr(ops, name)
        key = "silu_mul" if name == "bf16_linear_silu" else name  # silu * up alone or in the gate_up product
        monkeypatch.setattr(
            ops,
            name,
            lambda *a, _real=real, _name=key, **k: (
                calls.__setitem__(_name, calls.get(_name, 0) + 1),
                _real(*a, **k),
            )[1],
        )
    real_layers = decode_layers.DecodeLayers.forward
    monkeypatch.setattr(
        decode_layers.DecodeLayers,
        "forward",
        lambda *a, **k: (
            calls.__setitem__("decode_layers", calls.get("decode_layers", 0) + 1),
            real_layers(*a, **k),
        )[1],
    )
    with_kernels = decode_logits(fused, prompts, forced)
    layers = hf.config.num_hidden_layers
    if not build.bf16_linear_available():  # op by op, each op a kernel (srt_gemv's plain loops lose here)
        assert calls["decode_attention"] == layers * 6 and "decode_layers" not in calls
    else:  # one rank: each decode layer is one fused kernel call; prefill runs op by op
        assert calls["decode_layers"] == 6 and "decode_attention" not in calls  # every layer, once a step
        rotations = 2 if arch == "qwen3" else 1  # q and k apart where each has its norm, else together
        assert calls["rope"] == rotations * layers and calls["silu_mul"] == layers

    monkeypatch.setattr(ops, "usable", lambda *tensors: False)
    plain = ModelRunner(config)
    assert not plain.attn_backend.kernel_attention  # type: ignore[attr-defined]
    without = decode_logits(plain, prompts, forced)

    err_kernels = (with_kernels - ref).abs().max().item()
    err_torch = (without - ref).abs().max().item()
    assert err_kernels <= 1.5 * err_torch + 1e-3, (err_kernels, err_torch)


@pytest.mark.parametrize(("n", "hkv", "d"), [(1, 1, 64), (37, 3, 64), (4096, 2, 128)])
def test_store_kv_writes_the_rows_index_copy_writes(n: int, hkv: int, d: int) -> None:
    """k and v as the extend path has them (column slices of one qkv output) into slots in any order."""
    qkv = rand(n, (4 + 2) * hkv * d, seed=n)
    k = qkv[:, 4 * hkv * d : 5 * hkv * d].reshape(n, hkv, d)
    v = qkv[:, 5 * hkv * d :].reshape(n, hkv, d)
    slots = n + 50
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(1))[:n]
    k_cache, v_cache = rand(slots, hkv, d, seed=2), rand(slots, hkv, d, seed=3)
    want_k, want_v = k_cache.clone().index_copy_(0, loc, k), v_cache.clone().index_copy_(0, loc, v)
    assert ops.store_kv_applies(k, v, k_cache, v_cache, loc)
    ops.store_kv(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert not ops.store_kv_applies(k, v, k_cache.float(), v_cache, loc)  # the pool's dtype decides
    assert not ops.store_kv_applies(k, v, k_cache, v_cache, loc.int())
    assert not ops.store_kv_applies(qkv[:, : 2 * hkv * d : 2].reshape(n, hkv, d), v, k_cache, v_cache, loc)


@pytest.mark.parametrize("shape", [(32, 49152), (3, 17), (2, 5), (1, 16)])
def test_argmax_is_torch_argmax_first_index_on_ties(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    logits = torch.randn(*shape, generator=g)
    logits[0, shape[1] // 2] = logits[0, -1] = 50.0  # a tie: the first index wins
    logits[-1] = float("-inf")  # a row of -inf: index 0, as torch
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    assert ops.argmax(logits.bfloat16()) is None and ops.argmax(logits[:, ::2]) is None  # torch's own there
