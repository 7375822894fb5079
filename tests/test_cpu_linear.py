"""The packed bf16 paths (our kernel on AMX, AVX-512 BF16 or AVX2 and FMA where the CPU has one, else
oneDNN) give F.linear's results and are used for every linear layer in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_executor.cpu.kernels import build, ops, packing
from model_executor.cpu.linear import (
    AMX_MAX_ROWS,
    is_kernel_packed,
    linear,
    linear_silu_mul,
    onednn_bf16_available,
    pack_blocks,
    pack_weight,
    packed_max_rows,
)
from model_executor.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(
    not (onednn_bf16_available() or build.bf16_linear_available()),
    reason="neither oneDNN bf16 nor our packed kernel on this CPU",
)
# A weight our kernel's tiles do not cover goes to oneDNN's packed bf16 GEMM, where it has one.
needs_onednn = pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 on this CPU")


@needs_onednn
@pytest.mark.parametrize("m", [1, 7, 64, AMX_MAX_ROWS + 3])
def test_packed_bf16_linear_matches_f_linear(m: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(m, 48, generator=g).bfloat16()
    packed = pack_weight(weight)
    assert packed is not None
    torch.testing.assert_close(
        linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-2, atol=1e-2
    )
    assert pack_weight(weight.float()) is None  # fp32 stays on F.linear


def test_bf16_runner_packs_every_linear(tiny_model_dirs: dict[str, Path]) -> None:
    runner = ModelRunner(
        RunnerConfig(model_dir=tiny_model_dirs["llama"], dtype=torch.bfloat16, max_total_tokens=256)
    )
    layers = [m for m in runner.model.modules() if hasattr(m, "packed_weight")]
    assert layers and all(m.packed_weight is not None for m in layers)
    fp32 = ModelRunner(
        RunnerConfig(model_dir=tiny_model_dirs["llama"], dtype=torch.float32, max_total_tokens=256)
    )
    assert all(m.packed_weight is None for m in fp32.model.modules() if hasattr(m, "packed_weight"))


needs_packed = pytest.mark.skipif(
    not build.bf16_linear_available(), reason="neither AMX nor AVX-512 BF16 nor AVX2 and FMA on this CPU"
)


def kernel_case(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 weight [n, k], bias and input [m, k] seeded by m, and the weight packed for srt_bf16_linear."""
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = pack_weight(weight)
    assert isinstance(packed, torch.Tensor) and is_kernel_packed(packed)
    return weight, bias, x, packed


@needs_packed
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 32, 33, 48, 64, 70])
def test_packed_linear_is_the_fp32_product_rounded_once(m: int) -> None:
    """Every row count a decode batch can have (AMX: tiles of 16 rows, pairs of them, partial last
    tiles; AVX-512: tiles of 6 rows and partial ones), with a bias; fp32 sums, so within one bf16
    rounding of the fp32 product."""
    weight, bias, x, packed = kernel_case(m, 96, 64)
    exact = F.linear(x.float(), weight.float(), bias.float())
    got = linear(x, weight, bias, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 96)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    assert torch.equal(linear(x, weight, None, packed), ops.bf16_linear(x, packed, None))


@pytest.mark.skipif(
    not build.bf16_linear_available() or build.amx_available(),
    reason="the AVX-512 BF16 and AVX2 kernels run only where AMX does not",
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(1024, 576), (352, 1056)])
def test_linear_without_amx_gives_each_row_the_same_bits_in_any_batch(threads: int, n: int, k: int) -> None:
    """Without AMX (AVX-512 BF16, or AVX2 and FMA) a row's outputs do not depend on the rows beside
    it nor on the thread count (each sum runs over k in one order whatever the row count, tiling
    and thread split): a request decodes the same tokens alone or in a batch, and speculative
    decoding's verify step gives the draft's bits. n = 1024 or 352 outputs, so that two threads
    share them (352: 11 blocks each, an odd count, and 5 and 6 gate blocks); every tail of the
    6-row (AVX-512) and 3-row (AVX2) tiles, AVX2's rows up to 8 against its panel path's 6-row
    tiles past 8 (9 rows, 64, the whole 70); all three output forms; the whole batch on 2 threads
    against its parts on `threads`."""
    weight, bias, x, packed = kernel_case(70, n, k)
    d = n // 2  # as a gate_up weight: gate rows 0 to d - 1, up rows d to n - 1

    def forms(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            ops.bf16_linear(rows, packed, bias),
            ops.bf16_linear(rows, packed, bias, torch.float32),
            ops.bf16_linear_silu(rows, packed),
        )

    whole = forms(x)
    assert whole[2].shape == (70, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64):
            for start in (0, 70 - rows):
                for got, want in zip(forms(x[start : start + rows]), whole):
                    assert torch.equal(got, want[start : start + rows]), (rows, start, threads)
    finally:
        torch.set_num_threads(before)


@needs_packed
def test_float32_outputs_are_the_float32_sums_of_the_bf16_weights() -> None:
    """Parity to float32 rounding: each fp32 output is within k * 2^-24 * sum |x w| of the exact
    sum (float64) of the same bf16 values, the bound of a float32 sum over k terms in any order."""
    weight, bias, x, packed = kernel_case(7, 256, 1536)
    exact = x.double() @ weight.double().T + bias.double()
    bound = 1536 * 2**-24 * (x.double().abs() @ weight.double().abs().T + bias.double().abs())
    got = ops.bf16_linear(x, packed, bias, torch.float32)
    assert ((got.double() - exact).abs() <= bound).all()


@needs_packed
@pytest.mark.parametrize("m", [1, 17, 64, AMX_MAX_ROWS, AMX_MAX_ROWS + 1])
def test_float32_logits_are_the_sums_unrounded(m: int) -> None:
    """An LM head's logits straight from the kernel are its float32 sums, not rounded to bf16 (a
    logit of 16 in bf16 is 0.06 from the next): rounded, they are the bf16 output; with and without
    a bias. Past the kernel's rows (F.linear, on AMX) they are the bf16 output widened."""
    weight, bias, x, packed = kernel_case(m, 160, 96)
    for b in (None, bias):
        got = linear(x, weight, b, packed, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == (m, 160)
        bf16_out = linear(x, weight, b, packed)
        assert torch.equal(got.bfloat16(), bf16_out)
        if m > packed_max_rows():
            assert torch.equal(got, bf16_out.float())
            continue
        want = x.float() @ weight.float().T + (0 if b is None else b.float())
        assert (got - want).abs().max().item() < 1e-4
        assert not torch.equal(got, bf16_out.float())
    assert torch.equal(
        ops.bf16_linear(x, packed, bias, out_dtype=torch.float32).bfloat16(), ops.bf16_linear(x, packed, bias)
    )


@needs_packed
@pytest.mark.parametrize("m", [1, 33])
def test_float32_logits_into_an_unaligned_buffer(m: int) -> None:
    """The fp32 epilogue writes whole cache lines with non-temporal stores where the output is
    64-byte aligned (as torch allocates it); an output that is not gets the same values by plain
    stores (a non-temporal store to an unaligned address would fault)."""
    weight, bias, x, packed = kernel_case(m, 160, 96)
    lib = build.kernels()
    assert lib is not None
    buffer = torch.full((m * 160 + 1,), float("nan"))
    out = buffer[1:]  # 4 bytes past a 64-byte boundary
    assert out.data_ptr() % 64 == 4
    lib.srt_bf16_linear_f32(x.data_ptr(), m, packed.data_ptr(), bias.data_ptr(), out.data_ptr(), 160, 96)
    assert torch.equal(out.view(m, 160), ops.bf16_linear(x, packed, bias, out_dtype=torch.float32))


@needs_packed
@pytest.mark.parametrize("m", [1, 15, 17, 32, 33, 64, AMX_MAX_ROWS])
def test_gate_up_with_silu_in_the_epilogue_equals_the_two_passes(m: int) -> None:
    """The MLP's gate_up product with silu(gate) * up in the kernel's epilogue gives exactly the values of
    the product stored in bf16 and then srt_silu_mul, in bf16 and in int8 (w8a8); a biased product
    and (on AMX) bf16 inputs past AMX_MAX_ROWS keep two passes; on AVX-512 BF16 those are fused too."""
    weight, bias, x, packed = kernel_case(m, 2 * 48, 64)  # gate rows 0-47, up rows 48-95
    fused = linear_silu_mul(x, packed, None)
    assert fused is not None and fused.shape == (m, 48)
    assert torch.equal(fused, ops.silu_mul(linear(x, weight, None, packed)))
    gate, up = F.linear(x.float(), weight.float()).split(48, dim=-1)
    torch.testing.assert_close(fused.float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)
    assert linear_silu_mul(x, packed, bias) is None
    many = torch.cat([x] * (AMX_MAX_ROWS // m + 1))
    if build.amx_available():
        assert packed_max_rows() == AMX_MAX_ROWS and linear_silu_mul(many, packed, None) is None
    else:
        fused_many = linear_silu_mul(many, packed, None)
        assert fused_many is not None and torch.equal(
            fused_many, ops.silu_mul(linear(many, weight, None, packed))
        )
    if build.int8_available():
        int8 = pack_weight(weight, "w8a8_int8")
        for rows in (x, many):  # int8: every row count
            fused = linear_silu_mul(rows, int8, None)
            assert fused is not None and torch.equal(fused, ops.silu_mul(linear(rows, weight, None, int8)))


@needs_packed
@needs_onednn
def test_shapes_the_tiles_do_not_cover_keep_onednn() -> None:
    weight = torch.randn(40, 64).bfloat16()  # 40 outputs: not whole pairs of 16
    packed = pack_weight(weight)
    assert packed is not None and not is_kernel_packed(packed)


def _gguf_kinds(n: int, k: int) -> dict[str, packing.GgufWeight]:
    """One packed weight of each GGUF block kind, random blocks (their values do not matter to which
    sums run): Q4_1, Q4_K with float32 d and m, Q4_K on a file's six-bit scales, Q5_K, Q8_0, Q6_K
    with float32 D and on a file's int8 scales."""
    g = torch.Generator().manual_seed(0)

    def scales(runs: int, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A file's super-block scales: per 256 k an fp32 factor, per run of `runs` an integer."""
        big = torch.rand(n, k // 256, generator=g) / 64
        small = torch.randint(low, high, (n, k // runs), generator=g).float()
        return big.repeat_interleave(256 // runs, dim=1) * small, big, small

    q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d, m = torch.rand(n, k // 32, generator=g), -torch.rand(n, k // 32, generator=g)
    (d6, big_d, sc), (m6, big_m, mn) = scales(32, 1, 64), scales(32, 0, 64)
    d8, big_d8, sc8 = scales(16, -128, 128)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q6 = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    kinds = {
        "Q4_1": pack_blocks((q4, d.half(), m.half()), None, None),
        "Q4_K": pack_blocks((q4, d, m), None, None),
        "Q4_K six-bit": pack_blocks((q4, d6, -m6), None, None, factors=(big_d, sc, -big_m, mn)),
        "Q5_K": pack_blocks(None, None, (torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8), d, m)),
        "Q8_0": pack_blocks(None, (q8, d.half()), None),
        "Q6_K": pack_blocks(None, (q6, torch.rand(n, k // 16, generator=g)), None),
        "Q6_K int8": pack_blocks(None, (q6, d8), None, factors=(big_d8, sc8)),
    }
    assert kinds["Q4_K six-bit"].packed.shape[-1] == packing.Q4KS_BLOCK_BYTES
    assert kinds["Q6_K int8"].packed.shape[-1] == packing.Q6KS_BLOCK_BYTES
    return kinds


@pytest.mark.skipif(
    not ops.gguf_rows_exact(),
    reason="the GGUF block kernels take every row count alike only "
    "on AVX-512 BF16 and VNNI without AMX tiles",
)
@pytest.mark.parametrize("threads", [1, 2])
def test_gguf_blocks_give_each_row_the_same_bits_in_any_batch(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--quantization gguf is batch-invariant where ops.gguf_rows_exact(): every row count runs on
    the blocks' own kernels, many rows on the blocks widened once to the values the few-row tiles
    build, so a row's outputs (bf16 + bias, float32, silu(gate) * up) are the same bits alone, in
    any slice of a 70-row batch, and on one or two threads: a request decodes the same tokens alone
    or in a batch, and a verify step's rows are plain decode's."""
    monkeypatch.setattr(ops, "exact_rows", True)  # as the wing sets it for speculation
    n, k = 96, 512
    bias = torch.randn(n).bfloat16()
    x = torch.randn(70, k).bfloat16()
    dummy = torch.empty(n, k, dtype=torch.bfloat16)  # read by no kernel path

    def forms(rows: torch.Tensor, packed: packing.GgufWeight) -> list[torch.Tensor]:
        out = [linear(rows, dummy, bias, packed), linear(rows, dummy, None, packed, torch.float32)]
        gated = linear_silu_mul(rows, packed, None)
        return out if gated is None else [*out, gated]

    before = torch.get_num_threads()
    for name, packed in _gguf_kinds(n, k).items():
        torch.set_num_threads(2)
        whole = forms(x, packed)
        torch.set_num_threads(threads)
        try:
            for rows in (1, 2, 3, 5, 12, 13, 16, 17, 40):
                for start in (0, 70 - rows):
                    for got, want in zip(forms(x[start : start + rows], packed), whole):
                        assert torch.equal(got, want[start : start + rows]), (name, rows, start, threads)
        finally:
            torch.set_num_threads(before)
