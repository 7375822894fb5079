"""--quantization w8a8_int8: the int8 kernel (AMX or AVX-512 VNNI) against the same quantization done in fp32, a
quantized model against its bf16 self and fp32 transformers, and a server that serves with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from server_fixture import Server
from test_cpu_kernels import decode_logits
from tiny_models import hf_float32, hf_forced_logits

from model_executor.cpu.kernels import build, decode_layers, ops, packing
from model_executor.cpu.weights import check_quantization
from model_executor.model_runner import ModelRunner, RunnerConfig
from srt.cli_args import parse_server_args
from srt.server_args import ServerArgs

needs_int8 = pytest.mark.skipif(
    build._compiler() is None or not build.int8_available(),
    reason="neither AMX int8 tiles nor AVX-512 VNNI here: --quantization w8a8_int8 is refused",
)


def quantized_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in fp32: per-output int8 weights, per-row int8 activations."""
    w_scale = weight.abs().amax(1) / 127
    q = torch.round(weight / w_scale[:, None]).clamp(-127, 127)
    xf = x.float()
    amax = xf.abs().amax(1)
    x_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xf * (1 / x_scale)[:, None]).clamp(-127, 127)  # the kernel multiplies by the reciprocal
    out = (xq @ q.T) * x_scale[:, None] * w_scale[None, :]
    return out if bias is None else out + bias.float()


@needs_int8
@pytest.mark.parametrize(
    ("m", "n", "k", "with_bias"),
    [
        (1, 960, 576, False),
        (5, 64, 128, True),
        (33, 3072, 576, False),
        (300, 576, 1536, True),
        (560, 64, 128, True),
    ],
)  # a second chunk of 3 blocks
def test_int8_linear_is_the_quantized_product(m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(n, k, generator=g) * 0.05
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    if m > 1:
        x[m // 2] = 0  # a row of zeros: its scale is 1 and its outputs the bias
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = packing.int8_pack(weight)
    assert packed.packed.dtype == (torch.int8 if build.amx_available() else torch.uint8)
    assert packed.packed.numel() == n * k
    out = ops.int8_linear(x, packed, bias).float()
    want = quantized_reference(x, weight, bias)
    # int32 sums are exact; what differs is the fp32 epilogue and the bf16 rounding of the output
    assert ((out - want).abs() <= want.abs() * 2**-8 + 1e-4).all(), (out - want).abs().max()
    exact = x.float() @ weight.T + (0 if bias is None else bias.float())
    assert (out - exact).norm() / exact.norm() < 0.02  # and int8 is close to the unquantized product


@needs_int8
def test_int8_model_decodes_close_to_fp32_with_and_without_the_fused_layer(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_dirs["llama"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 30, 7, 19, 1)]
    forced = [torch.randint(3, 320, (6,), generator=g).tolist() for _ in prompts]
    ref = hf_forced_logits(hf_float32(model_dir), prompts, forced)

    bf16 = decode_logits(
        ModelRunner(RunnerConfig(model_dir=model_dir, max_total_tokens=512)), prompts, forced
    )
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, max_total_tokens=512, quantization="w8a8_int8"))
    layer = runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.packed_weight, packing.Int8Weight)
    assert not isinstance(runner.model.lm_head.packed_weight, packing.Int8Weight)  # the LM head stays bf16
    fused_calls: list[int] = []
    real = decode_layers.DecodeLayers.forward
    monkeypatch.setattr(
        decode_layers.DecodeLayers, "forward", lambda *a, **k: (fused_calls.append(1), real(*a, **k))[1]
    )
    fused = decode_logits(runner, prompts, forced)
    assert len(fused_calls) == 6  # every decode step in the fused layer, on int8 weights

    monkeypatch.setattr(ops, "usable", lambda *tensors: False)  # op by op: each linear on the int8 kernel
    plain = decode_logits(
        ModelRunner(RunnerConfig(model_dir=model_dir, max_total_tokens=512, quantization="w8a8_int8")),
        prompts,
        forced,
    )
    scale = ref.abs().max().item()
    err_bf16, err_fused, err_plain = ((x - ref).abs().max().item() / scale for x in (bf16, fused, plain))
    assert err_fused < 0.06 and err_plain < 0.06, (err_bf16, err_fused, err_plain)
    assert (fused - plain).abs().max().item() / scale < 0.03  # the same int8 products either way
    assert err_fused > err_bf16  # int8 rounds more than bf16: the quantized weights were used


@needs_int8
def test_int8_smollm2_predicts_mostly_what_bf16_predicts(smollm2_dir: Path) -> None:
    """Teacher-forced on a real prompt, int8's next-token choice agrees with bf16's at most
    positions (measured over 1024 tokens of this repo's docs with transformers emulating the
    scheme: 90% top-1 agreement, NLL +0.7%)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:3000]
    ids = tokenizer.encode(text)[:97]
    prompt, forced = [ids[:33]], [ids[33:]]
    logits = {
        q: decode_logits(
            ModelRunner(RunnerConfig(model_dir=smollm2_dir, max_total_tokens=256, quantization=q)),
            prompt,
            forced,
        )[:, 0]
        for q in (None, "w8a8_int8")
    }
    agree = (logits[None].argmax(-1) == logits["w8a8_int8"].argmax(-1)).float().mean().item()
    assert agree >= 0.75, agree
    assert not torch.equal(logits[None], logits["w8a8_int8"])


def test_quantization_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--quantization w8a8_int8 needs --device cpu and --dtype bfloat16"):
        ServerArgs(quantization="w8a8_int8", dtype="float32")
    with pytest.raises(ValueError, match="--quantization must be one of w8a8_int8, gguf; got 'fp8'"):
        ServerArgs(quantization="fp8")
    with pytest.raises(SystemExit):
        parse_server_args(["--quantization", "int4"])
    assert parse_server_args(["--quantization", "w8a8_int8"]).quantization == "w8a8_int8"
    with pytest.raises(ValueError, match="runs on --device cpu with bfloat16 activations"):
        check_quantization("w8a8_int8", torch.float32, "cpu")
    monkeypatch.setattr(build, "int8_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with AMX int8 tiles .* or AVX-512 VNNI"):
        check_quantization("w8a8_int8", torch.bfloat16, "cpu")
    check_quantization(None, torch.float32, "cpu")  # no quantization: nothing to check


@needs_int8
def test_server_serves_with_int8_weights() -> None:
    with Server("--quantization", "w8a8_int8", "--max-total-tokens", "2048") as server:
        response = server.generate(
            {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        )
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 8
        assert "packed 121 weights for the CPU kernels, of them 120 int8 (w8a8_int8)" in server.output()
