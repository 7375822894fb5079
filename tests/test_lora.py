"""LoRA adapters (issue 61): peft's adapters on tiny random models and on the bundled SmolLM2, served
beside the base model in one batch, each row held to transformers + PeftModel on the same weights;
the prefix cache keyed by adapter; what srt does not implement refused at start-up by name."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from scheduler_harness import Harness
from server_fixture import Server
from tiny_models import hf_float32, hf_greedy, make_tiny_model

from model_executor.cpu.fused_ops import CpuFusedOps
from model_executor.cpu.kernels import build
from model_executor.cpu.kernels.decode_layers import DecodeLayers
from model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from model_executor.layers.fused_ops import FusedOps
from model_executor.layers.linear_method import UnquantizedLinearMethod
from model_executor.lora.linear_method import LayerLora, LoraBatch, LoraLinearMethod, LoraPart
from model_executor.model_runner import ModelRunner, RunnerConfig
from srt.cli_args import parse_server_args
from srt.io_struct import TokenizedGenerateReq
from srt.lora_config import LoraRef
from srt.sampling_params import SamplingParams

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 12


def make_adapter(
    base: Path, path: Path, targets: list[str], rank: int, seed: int, b_std: float = 0.05, **config: Any
) -> Path:
    """A peft adapter on `base` with lora_B random (peft starts it at zero: no change at all)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, **config)
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    lora.save_pretrained(path)
    return path


def peft_model(base: Path, adapter: Path | None, dtype: torch.dtype = torch.float32) -> Any:
    model = hf_float32(base).to(dtype)
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen2 (q/k/v biases, GQA) and three adapters: rank 8 on q and v, rank 16 on every
    linear layer, rank 4 on the row-parallel o and down projections alone."""
    return tiny_adapters(tmp_path_factory.mktemp("lora"))


def tiny_adapters(root: Path) -> dict[str, Path]:
    """The `tiny` fixture's model and adapters, made under `root`."""
    base = make_tiny_model("qwen2", root / "base")
    return {
        "base": base,
        "qv8": make_adapter(base, root / "qv8", ["q_proj", "v_proj"], 8, seed=1),
        "all16": make_adapter(base, root / "all16", ALL_LINEAR, 16, seed=2),
        "rows4": make_adapter(base, root / "rows4", ["o_proj", "down_proj"], 4, seed=3, use_rslora=True),
    }


def tiny_server_flags(tiny: dict[str, Path], tokenizer: Path) -> list[str]:
    """The tiny base in float32 with the three adapters (a tokenizer for a server: SmolLM2's)."""
    flags = ["--model-path", str(tiny["base"]), "--tokenizer-path", str(tokenizer), "--dtype", "float32"]
    paths = [f"{name}={tiny[name]}" for name in ("qv8", "all16", "rows4")]
    return [*flags, "--max-total-tokens", "4096", "--lora-paths", *paths]


def prefill_logits(runner: ModelRunner, batch_prompts: list[list[int]], lora_ids: list[int]) -> torch.Tensor:
    """The last logits of one prefill batch of whole prompts, request i under adapter lora_ids[i]."""
    rows = [runner.req_to_token_pool.alloc() for _ in batch_prompts]
    lens = [len(p) for p in batch_prompts]
    loc = runner.memory.alloc_extend(rows, [0] * len(rows), lens)  # type: ignore[arg-type]
    tokens = [t for p in batch_prompts for t in p]
    return runner.forward(
        make_forward_batch(ForwardMode.EXTEND, tokens, rows, [0] * len(rows), lens, loc, lora_ids=lora_ids)  # type: ignore[arg-type]
    )


def edited_adapter(src: Path, dst: Path, **fields: Any) -> Path:
    """A copy of the adapter at `src` whose adapter_config.json has `fields` set."""
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return dst


def layer_loras(k: int, seed: int) -> LoraLinearMethod:
    """A qkv-like layer (outputs 64 + 32 + 32) with three adapters in slots 0, 1 and 3: q/k/v of
    ranks 8, 4 and 16; q and v only; v alone."""
    g = torch.Generator().manual_seed(seed)
    method = LoraLinearMethod(UnquantizedLinearMethod(), LoraBatch())
    outputs = {"q": slice(0, 64), "k": slice(64, 96), "v": slice(96, 128)}
    for slot, ranks in ((0, {"q": 8, "k": 4, "v": 16}), (1, {"q": 8, "v": 8}), (3, {"v": 2})):
        parts, start = [], 0
        for name, rank in ranks.items():
            cols = outputs[name]
            b = torch.randn(cols.stop - cols.start, rank, generator=g) * 0.1
            parts.append(LoraPart(slice(start, start + rank), cols, b.T.contiguous()))
            start += rank
        method.attach(slot, LayerLora(torch.randn(start, k, generator=g) / k**0.5, tuple(parts)))
    return method


def deltas(
    method: LoraLinearMethod, ops: FusedOps, out: torch.Tensor, x: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    method.batch.start(torch.tensor(slots, dtype=torch.int32))
    result = out.clone()
    ops.lora_delta(result, x, method)
    return result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpu_kernel_adds_every_adapters_delta_in_one_call_and_each_row_alone(dtype: torch.dtype) -> None:
    """cpu_lora.c against the torch products: every adapter's rows of a step in one call, equal to
    the grouped matmuls within float32's rounding, rows without an adapter untouched, and each row's
    bits those it gets alone (batch-invariant)."""
    k = 96
    method = layer_loras(k, seed=5)
    assert method.table is not None, "the kernel takes these adapters"
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, k, generator=g).to(dtype)
    out = torch.randn(9, 128, generator=g).to(dtype)
    slots = [0, -1, 1, 3, 0, 2, 1, -1, 3]  # slot 2 holds nothing: a base row here
    fast = deltas(method, CpuFusedOps(), out, x, slots)
    slow = deltas(method, FusedOps(), out, x, slots)
    base = [i for i, s in enumerate(slots) if s in (-1, 2)]
    assert torch.equal(fast[base], out[base])
    assert not torch.equal(fast, out)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # one bf16 rounding of a different sum
    torch.testing.assert_close(fast.float(), slow.float(), rtol=tolerance, atol=tolerance)
    for i, s in enumerate(slots):
        assert torch.equal(deltas(method, CpuFusedOps(), out[i : i + 1], x[i : i + 1], [s])[0], fast[i])
    method.attach(0, None)  # an adapter leaves: its rows are base rows from then on
    assert torch.equal(deltas(method, CpuFusedOps(), out, x, slots)[0], out[0])


def test_a_mixed_prefill_batch_gives_each_row_peft_logits(tiny: dict[str, Path]) -> None:
    """fp32: one prefill batch holding the base model and three adapters (one twice), each row's
    last logits within fp32's summation noise of transformers + PeftModel, and far from the base's."""
    names = ("qv8", "all16", "rows4")
    refs = tuple(LoraRef(name, str(tiny[name])) for name in names)
    runner = ModelRunner(
        RunnerConfig(model_dir=tiny["base"], dtype=torch.float32, max_total_tokens=512, lora_adapters=refs)
    )
    batch_prompts = prompts(320, (5, 17, 1, 9, 12), seed=4)
    ids = [0, 1, 2, 3, 1]  # adapter ids: --lora-paths order from 1
    # fp32 weights: the fused CPU decode layer (which adds adapters) takes no batch here
    assert runner.step_runner.takes_lora and not runner.step_runner.can_run(decode_batch(runner, [3], [1]))
    ours = prefill_logits(runner, batch_prompts, ids)
    base = peft_model(tiny["base"], None)
    for prompt, adapter, logits in zip(batch_prompts, ids, ours):
        model = peft_model(tiny["base"], tiny[names[adapter - 1]]) if adapter else base
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
            plain = base(torch.tensor([prompt])).logits[0, -1]
        assert (logits - ref).abs().max().item() < 2e-4
        if adapter:
            assert (ref - plain).abs().max().item() > 0.05  # the adapter changes what the row computes


def decode_batch(runner: ModelRunner, lens: list[int], lora_ids: list[int]) -> ForwardBatch:
    """One decode step of requests whose first `lens` tokens were prefilled (under `lora_ids`): a
    new token each, its KV slot allocated."""
    rows = [int(runner.req_to_token_pool.alloc()) for _ in lens]  # type: ignore[arg-type]
    loc = runner.memory.alloc_extend(rows, [0] * len(rows), lens)
    tokens = [3 + (i * 7) % 300 for n in lens for i in range(n)]
    runner.forward(
        make_forward_batch(ForwardMode.EXTEND, tokens, rows, [0] * len(rows), lens, loc, lora_ids=lora_ids)
    )
    seqs = [n + 1 for n in lens]
    loc = runner.memory.alloc_extend(rows, lens, seqs)
    return make_forward_batch(
        ForwardMode.DECODE, [7 + i for i in range(len(rows))], rows, lens, seqs, loc, lora_ids=lora_ids
    )


@pytest.mark.skipif(not build.bf16_linear_available(), reason="no fused decode layer on this CPU")
def test_the_fused_decode_layer_adds_each_rows_adapter_as_the_layers_do(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 with LoRA on: a decode step mixing the base model and three adapters runs as whole fused
    layers (srt_decode_layer adding the deltas), within the fused layer's rounding of the same step op
    by op; each adapter row moves, and a base row gets the bits it gets in a step of base rows."""
    refs = tuple(LoraRef(name, str(tiny[name])) for name in ("qv8", "all16", "rows4"))
    runner = ModelRunner(
        RunnerConfig(model_dir=tiny["base"], dtype=torch.bfloat16, max_total_tokens=1024, lora_adapters=refs)
    )
    lens, ids = [5, 17, 9, 12], [0, 1, 2, 3]
    fused_calls: list[int] = []
    real = DecodeLayers.forward
    monkeypatch.setattr(DecodeLayers, "forward", lambda *a, **k: (fused_calls.append(1), real(*a, **k))[1])
    batch = decode_batch(runner, lens, ids)
    assert runner.step_runner.can_run(batch)
    fused = runner.forward(batch)
    plain = runner.forward(decode_batch(runner, lens, [0] * 4))  # the same requests on the base model
    assert fused_calls == [1, 1]
    monkeypatch.setattr(runner.step_runner, "can_run", lambda batch: False)
    layers = runner.forward(decode_batch(runner, lens, ids))
    assert fused_calls == [1, 1]
    scale = layers.abs().max().item()
    assert (fused - layers).abs().max().item() < 0.02 * scale
    assert torch.equal(fused[0], plain[0])
    for row in (1, 2, 3):
        assert (fused[row] - plain[row]).abs().max().item() > 0.05 * scale


@pytest.fixture(scope="module")
def tiny_server(tiny: dict[str, Path], smollm2_dir: Path) -> Iterator[Server]:
    with Server(*tiny_server_flags(tiny, smollm2_dir)) as server:
        yield server


def generate_batch(
    server: Server, batch: list[list[int]], adapters: list[str | None], max_new: int = MAX_NEW, **fields: Any
) -> list[dict[str, Any]]:
    """Greedy outputs of one /generate batch, prompt i under adapters[i]."""
    sampling = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    reply = server.generate(
        {"input_ids": batch, "lora_path": adapters, "sampling_params": sampling, **fields}
    )
    assert reply.status_code == 200, reply.text
    out: list[dict[str, Any]] = reply.json()
    return out


def reference_tokens(
    tiny: dict[str, Path], batch: list[list[int]], adapters: list[str | None], steps: int = MAX_NEW
) -> list[list[int]]:
    return [
        hf_greedy(peft_model(tiny["base"], None if name is None else tiny[name]), prompt, steps)
        for prompt, name in zip(batch, adapters)
    ]


MIXED = [None, "qv8", "all16", "rows4", "all16", None]


def test_one_generate_batch_mixing_adapters_gives_each_row_peft_tokens(
    tiny: dict[str, Path], tiny_server: Server
) -> None:
    """fp32 through the server: a /generate batch of the base model and every adapter (prefill and
    decode steps mixing them) gives each row the greedy tokens of transformers + PeftModel."""
    batch = prompts(320, (6, 11, 3, 20, 11, 8), seed=5)
    outs = generate_batch(tiny_server, batch, MIXED)
    expected = reference_tokens(tiny, batch, MIXED)
    assert [o["output_ids"] for o in outs] == expected
    base_tokens = reference_tokens(tiny, batch, [None] * len(batch))
    changed = [name for name, ours, base in zip(MIXED, expected, base_tokens) if ours != base]
    assert {"qv8", "all16", "rows4"} <= set(changed)  # each adapter changes its row's tokens


def test_the_prefix_cache_never_serves_one_adapters_kv_to_another(tiny_server: Server) -> None:
    """The same prompt under qv8, then all16, then the base: none reuses another's prefix
    (cached_tokens 0); qv8's second request reuses its own."""
    prompt = prompts(320, (40,), seed=6)[0]

    def cached(adapter: str | None) -> int:
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
        }
        reply = tiny_server.generate({**body, "lora_path": adapter})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["meta_info"]["cached_tokens"])

    assert cached("qv8") == 0
    assert cached("all16") == 0
    assert cached(None) == 0
    assert cached("qv8") >= 39  # its own prompt, all but the token whose logits it needs
    assert cached("all16") >= 39


def test_an_unknown_adapter_is_a_400_naming_lora_path(tiny_server: Server) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    reply = tiny_server.generate({**body, "lora_path": "nope"})
    assert reply.status_code == 400 and "lora_path" in reply.text and "nope" in reply.text
    reply = tiny_server.generate({**body, "input_ids": [[5, 6], [7]], "lora_path": ["qv8", "nope"]})
    assert reply.status_code == 400 and "nope" in reply.text


def test_openai_model_selects_an_adapter_both_ways(tiny: dict[str, Path], tiny_server: Server) -> None:
    """The official client: `model` as the adapter's name (vLLM) or base:adapter (SGLang) runs the
    adapter, the served name runs the base; /v1/models lists each adapter with the base as parent;
    base:unknown is a 400 naming model."""
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none")
    served = str(tiny["base"])
    prompt = prompts(320, (9,), seed=7)[0]

    def generate_text(adapter: str | None) -> str:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
        }
        return str(tiny_server.generate({**body, "lora_path": adapter}).json()["text"])

    def completion_text(model: str) -> str:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0, extra_body={"ignore_eos": True}
        )
        return out.choices[0].text

    adapter_text, base_text = generate_text("all16"), generate_text(None)
    assert adapter_text != base_text
    assert completion_text("all16") == completion_text(f"{served}:all16") == adapter_text
    assert completion_text(served) == base_text
    with pytest.raises(openai.BadRequestError) as refused:
        completion_text(f"{served}:nope")
    assert refused.value.body["param"] == "model"  # type: ignore[index]
    cards = requests.get(tiny_server.url + "/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [
        (served, None),
        *((name, served) for name in ("qv8", "all16", "rows4")),
    ]
    assert client.models.retrieve("qv8").id == "qv8"


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["--tp-size", "2"], pytest.param(["--pp-size", "2"], marks=pytest.mark.slow, id="pp2")],
    ids=str,
)
def test_tp2_and_pp2_give_the_tokens_of_tp1(
    tiny: dict[str, Path], smollm2_dir: Path, layout: list[str]
) -> None:
    """The adapters sharded as their layers (B's rows for column-parallel, A's columns for row-parallel,
    added before the all-reduce) at TP=2 over gloo, or each stage's layers' at PP=2: one batch mixing
    the base and three adapters gets the tokens of TP=1 and of PeftModel."""
    batch = prompts(320, (6, 11, 3, 20, 11, 8), seed=5)
    with Server(*tiny_server_flags(tiny, smollm2_dir), *layout) as server:
        outs = generate_batch(server, batch, MIXED)
    assert [o["output_ids"] for o in outs] == reference_tokens(tiny, batch, MIXED)


@pytest.mark.parametrize("limit", [1, 8])
def test_max_loras_per_batch_bounds_the_adapters_of_a_batch(tiny: dict[str, Path], limit: int) -> None:
    """--max-loras-per-batch: no step holds more distinct adapters (the base not counted); the
    requests past it wait for a later batch and get the tokens they get without the limit."""
    paths = tuple(f"{name}={tiny[name]}" for name in ("qv8", "all16", "rows4"))
    harness = Harness(tiny["base"], lora_paths=paths, max_loras_per_batch=limit, max_total_tokens=2048)
    seen: list[set[int]] = []
    get_next_batch = harness.scheduler.admission.get_next_batch

    def recording(step: int) -> Any:
        batch = get_next_batch(step)
        if batch is not None:
            seen.append({r.lora_id for r in batch.reqs} - {0})
        return batch

    harness.scheduler.admission.get_next_batch = recording  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    batch = prompts(320, (5, 6, 7, 8), seed=10)
    names = [None, "qv8", "all16", "rows4"]
    for i, (prompt, name) in enumerate(zip(batch, names)):
        harness.send(TokenizedGenerateReq(f"r{i}", prompt, params, 0, lora_path=name))
    harness.run_until_idle()
    assert max(len(s) for s in seen) == min(limit, 3)
    assert [harness.tokens[f"r{i}"] for i in range(4)] == reference_tokens(tiny, batch, names, 4)


# ---- the default path (bf16) on the bundled SmolLM2 ----

SMOL_PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
]
SMOL_NEW = 8


@pytest.fixture(scope="module")
def smol_adapters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol_lora")
    return {
        "qv8": make_adapter(smollm2_dir, root / "qv8", ["q_proj", "v_proj"], 8, seed=11, b_std=0.15),
        "all64": make_adapter(smollm2_dir, root / "all64", ALL_LINEAR, 64, seed=12, b_std=0.02),
    }


@pytest.mark.slow
def test_smollm2_bf16_rows_get_peft_tokens_and_base_rows_their_bits(
    smollm2_dir: Path, smol_adapters: dict[str, Path]
) -> None:
    """The default path (bf16) with adapters of rank 8 on q and v and rank 64 on every linear layer:
    one batch mixing them with the base gives each row transformers + PeftModel's greedy tokens
    wherever transformers' bf16 keeps its float32 tokens; and a base row's logprobs are the same bits
    in that batch as in a batch of base rows alone (with --enable-lora every batch runs the layers op
    by op, and an adapter's delta touches its own rows only)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tokenizer(p)["input_ids"] for p in SMOL_PROMPTS]
    adapters: list[str | None] = [None, "qv8", "all64", "qv8"]
    flags = [f"{name}={path}" for name, path in smol_adapters.items()]
    with Server("--model-path", str(smollm2_dir), "--lora-paths", *flags) as server:
        mixed = generate_batch(server, ids, adapters, SMOL_NEW, return_logprob=True)
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
        alone = generate_batch(server, ids, [None] * len(ids), SMOL_NEW, return_logprob=True)
    assert mixed[0]["output_ids"] == alone[0]["output_ids"]
    assert mixed[0]["meta_info"]["output_token_logprobs"] == alone[0]["meta_info"]["output_token_logprobs"]
    agreed, changed = 0, set()
    for prompt, name, out in zip(ids, adapters, mixed):
        adapter = None if name is None else smol_adapters[name]
        fp32 = hf_greedy(peft_model(smollm2_dir, adapter), prompt, SMOL_NEW)
        bf16 = hf_greedy(peft_model(smollm2_dir, adapter, torch.bfloat16), prompt, SMOL_NEW)
        if fp32 != hf_greedy(peft_model(smollm2_dir, None), prompt, SMOL_NEW):
            changed.add(name)
        if fp32 == bf16:
            agreed += 1
            assert out["output_ids"] == fp32, (name, tokenizer.decode(prompt))
    assert agreed >= len(ids) // 2, "too few rows where transformers' bf16 keeps float32's tokens"
    assert changed == {"qv8", "all64"}  # each adapter changes the tokens of a row it runs


# ---- refused at start-up, by name ----


@pytest.mark.parametrize(
    ("field", "value", "flags"),
    [
        ("use_dora", True, []),
        ("modules_to_save", ["lm_head"], []),
        ("bias", "all", []),
        ("r", 8, ["--max-lora-rank", "4"]),
    ],
)
def test_an_adapter_srt_does_not_implement_is_refused_naming_the_field(
    tiny: dict[str, Path], tmp_path: Path, field: str, value: Any, flags: list[str]
) -> None:
    bad = edited_adapter(tiny["qv8"], tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=field):
        parse_server_args(["--lora-paths", f"bad={bad}", *flags])


def test_launch_server_refuses_a_bad_adapter_before_starting_ranks(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    bad = edited_adapter(tiny["qv8"], tmp_path / "dora", use_dora=True)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "srt.launch_server",
            "--model-path",
            str(tiny["base"]),
            "--lora-paths",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "use_dora" in run.stderr


def test_lora_paths_take_names_and_bare_folders(tiny: dict[str, Path]) -> None:
    args = parse_server_args(["--lora-paths", f"mine={tiny['qv8']}", str(tiny["all16"]) + "/"])
    assert [(a.name, Path(a.path)) for a in args.lora_adapters] == [
        ("mine", tiny["qv8"]),
        ("all16", tiny["all16"]),
    ]
    assert args.lora_enabled and parse_server_args(args.to_cli()).lora_adapters == args.lora_adapters
    with pytest.raises(ValueError, match="twice"):
        parse_server_args(["--lora-paths", f"a={tiny['qv8']}", f"a={tiny['all16']}"])
    with pytest.raises(ValueError, match="lora-target-modules"):
        parse_server_args(["--lora-paths", str(tiny["all16"]), "--lora-target-modules", "q_proj", "v_proj"])
    assert parse_server_args(["--enable-lora", "--restart-on-failure", "1"]).deterministic  # row by row
    with pytest.raises(ValueError, match="needs --enable-lora"):
        parse_server_args(["--max-lora-rank", "8"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma3_adapters_on_every_linear_match_peft(tmp_path: Path, dtype: torch.dtype) -> None:
    """A tiny Gemma 3 (post-norm layers, sliding and global attention): an adapter on every linear
    layer gives PeftModel's last logits in one prefill batch beside the base model (fp32: within
    fp32's summation noise; bf16, the default path: within twice the distance of transformers' own
    bf16 from its fp32)."""
    base = make_tiny_model("gemma3", tmp_path / "gemma3")
    adapter = make_adapter(base, tmp_path / "all8", ALL_LINEAR, 8, seed=13, b_std=0.1)
    runner = ModelRunner(
        RunnerConfig(
            model_dir=base, dtype=dtype, max_total_tokens=512, lora_adapters=(LoraRef("all8", str(adapter)),)
        )
    )
    batch_prompts = prompts(200, (9, 6), seed=14)
    ours = prefill_logits(runner, batch_prompts, [1, 0])
    with torch.no_grad():
        for prompt, name, logits in zip(batch_prompts, (adapter, None), ours):
            ref = peft_model(base, name)(torch.tensor([prompt])).logits[0, -1]
            if dtype == torch.float32:
                assert (logits - ref).abs().max().item() < 2e-4
                continue
            own = peft_model(base, name, torch.bfloat16)(torch.tensor([prompt])).logits[0, -1].float()
            assert (logits - ref).abs().max().item() <= 2 * (own - ref).abs().max().item() + 1e-3
        plain = peft_model(base, None)(torch.tensor([batch_prompts[0]])).logits[0, -1]
        assert (ours[0] - plain).abs().max().item() > 0.05  # the adapter moves its row


def test_moe_attention_adapters_run_and_experts_are_refused_by_name(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE: an adapter on the attention matches PeftModel (fp32 logits); one on a
    mixture's experts is refused at load, naming them."""
    base = make_tiny_model("qwen3_moe", tmp_path / "moe")
    attn = make_adapter(base, tmp_path / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"], 8, seed=8)
    runner = ModelRunner(
        RunnerConfig(
            model_dir=base,
            dtype=torch.float32,
            max_total_tokens=256,
            lora_adapters=(LoraRef("attn", str(attn)),),
        )
    )
    batch_prompts = prompts(320, (7, 4), seed=9)
    ours = prefill_logits(runner, batch_prompts, [1, 0])
    with torch.no_grad():
        ref = [peft_model(base, attn), peft_model(base, None)]
        for prompt, model, logits in zip(batch_prompts, ref, ours):
            assert (logits - model(torch.tensor([prompt])).logits[0, -1]).abs().max().item() < 2e-4

    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text((attn / "adapter_config.json").read_text())
    module = "model.layers.0.mlp.experts.3.gate_proj"
    save_file(
        {
            f"base_model.model.{module}.lora_A.weight": torch.randn(8, 64),
            f"base_model.model.{module}.lora_B.weight": torch.randn(64, 8),
        },
        str(experts / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match=f"target module {module} is a mixture's experts"):
        ModelRunner(
            RunnerConfig(
                model_dir=base,
                dtype=torch.float32,
                max_total_tokens=256,
                lora_adapters=(LoraRef("e", str(experts)),),
            )
        )


def test_an_adapter_for_modules_the_model_lacks_is_refused_naming_them(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """Targets the base model has no linear layer for (another architecture's names, a mixture's
    experts) are refused when the rank attaches the adapter, naming the module."""
    for module, what in (("model.layers.0.self_attn.c_attn", "no linear layer"),):
        bad = tmp_path / module.replace(".", "_")
        bad.mkdir()
        (bad / "adapter_config.json").write_text((tiny["qv8"] / "adapter_config.json").read_text())
        tensors = {
            f"base_model.model.{module}.lora_A.weight": torch.randn(8, 64),
            f"base_model.model.{module}.lora_B.weight": torch.randn(64, 8),
        }
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=f"target module {module} is {what}"):
            ModelRunner(
                RunnerConfig(
                    model_dir=tiny["base"],
                    dtype=torch.float32,
                    max_total_tokens=256,
                    lora_adapters=(LoraRef("bad", str(bad)),),
                )
            )
