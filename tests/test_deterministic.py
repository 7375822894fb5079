"""--enable-deterministic-inference on the default path (SmolLM2, bf16, the CPU kernels): a token's
logits and K/V have the same bits whether it was prefilled (at once, in chunks, behind a cached
prefix) or decoded, alone or in a batch. Without the mode they do not, which is why a replay (it
re-prefills tokens first decoded) could part from the fault-free tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from server_fixture import Server

from model_executor.cpu.kernels import build
from model_executor.cpu.linear import set_one_arithmetic
from model_executor.forward_batch import ForwardMode, make_forward_batch
from model_executor.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.skipif(build.kernels() is None, reason="the CPU kernels did not build here")

PROMPT = [1, 504, 3458, 314, 260, 3656, 282, 4722, 30, 378, 2151, 288, 260, 15661, 282, 253, 1789, 29]
FORCED = [2498, 6520, 28, 270, 1317, 702, 1789, 325, 4722, 314, 253, 2536, 28, 27, 7845, 3582]
OTHERS = [[1, 9906, 11, 1450, 4500, 29], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.fixture(scope="module")
def runners(smollm2_dir: Path) -> dict[bool, ModelRunner]:
    made = {
        on: ModelRunner(
            RunnerConfig(
                model_dir=smollm2_dir,
                dtype=torch.bfloat16,
                max_total_tokens=512,
                max_running_requests=8,
                deterministic=on,
            )
        )
        for on in (False, True)
    }
    yield made
    set_one_arithmetic(False)


def extend(
    runner: ModelRunner,
    rows: list[int],
    prefixes: list[int],
    parts: list[list[int]],
    token_logits: bool = False,
) -> torch.Tensor:
    """One extend step; logits of every new token (token_logits) or of each request's last."""
    seqs = [p + len(t) for p, t in zip(prefixes, parts)]
    loc = runner.memory.alloc_extend(rows, prefixes, seqs)
    batch = make_forward_batch(
        ForwardMode.EXTEND, [t for part in parts for t in part], rows, prefixes, seqs, loc
    )
    every = list(range(sum(len(t) for t in parts))) if token_logits else None
    last, tokens = runner.forward_with_token_logits(batch, every)
    return tokens if token_logits else last  # type: ignore[return-value]


def decode(runner: ModelRunner, rows: list[int], prefixes: list[int], ids: list[int]) -> torch.Tensor:
    seqs = [p + 1 for p in prefixes]
    loc = runner.memory.alloc_extend(rows, prefixes, seqs)
    return runner.forward(make_forward_batch(ForwardMode.DECODE, ids, rows, prefixes, seqs, loc))


def kv_of(runner: ModelRunner, row: int, n: int) -> torch.Tensor:
    slots = runner.req_to_token_pool.req_to_token[row, :n]
    return torch.stack(
        [
            torch.cat([k[slots], v[slots]])
            for k, v in (runner.kv_pool.get_kv_buffer(i) for i in range(runner.model.kv_cache_layout()[0]))
        ]
    )


def fresh(runner: ModelRunner, n: int) -> list[int]:
    return [int(runner.req_to_token_pool.alloc()) for _ in range(n)]  # type: ignore[arg-type]


def ways(runner: ModelRunner) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The logits of each FORCED token's position and the K/V of PROMPT + FORCED, four ways."""
    seq = PROMPT + FORCED
    out = {}
    # decoded alone, token by token after the prompt's prefill
    (row,) = fresh(runner, 1)
    steps = [extend(runner, [row], [0], [PROMPT])[0]]
    for i, t in enumerate(FORCED[:-1]):
        steps.append(decode(runner, [row], [len(PROMPT) + i], [t])[0])
    out["decoded alone"] = (torch.stack(steps), kv_of(runner, row, len(seq) - 1))
    # decoded in a batch of three (other requests of other lengths beside it)
    rows = fresh(runner, 3)
    first = extend(runner, rows, [0, 0, 0], [PROMPT] + OTHERS)
    steps, prefixes = [first[0]], [len(PROMPT)] + [len(o) for o in OTHERS]
    for t in FORCED[:-1]:
        steps.append(decode(runner, rows, prefixes, [t, 17, 42])[0])
        prefixes = [p + 1 for p in prefixes]
    out["decoded in a batch"] = (torch.stack(steps), kv_of(runner, rows[0], len(seq) - 1))
    # prefilled at once: every token's logits from one extend
    (row,) = fresh(runner, 1)
    logits = extend(runner, [row], [0], [seq[:-1]], token_logits=True)
    out["prefilled at once"] = (logits[len(PROMPT) - 1 :], kv_of(runner, row, len(seq) - 1))
    # prefilled in chunks of 7 behind the cached start (a chunked prefill, a prefix hit)
    (row,) = fresh(runner, 1)
    chunks, done = [], 0
    while done < len(seq) - 1:
        part = seq[done : min(done + 7, len(seq) - 1)]
        chunks.append(extend(runner, [row], [done], [part], token_logits=True))
        done += len(part)
    out["prefilled in chunks"] = (torch.cat(chunks)[len(PROMPT) - 1 :], kv_of(runner, row, len(seq) - 1))
    return out


def test_prefill_and_decode_give_one_token_the_same_bits(runners: dict[bool, ModelRunner]) -> None:
    set_one_arithmetic(True)
    got = ways(runners[True])
    want_logits, want_kv = got["decoded alone"]
    for name, (logits, kv) in got.items():
        assert torch.equal(kv, want_kv), f"{name}: K/V differ from decode's"
        assert torch.equal(logits, want_logits), (
            f"{name}: logits differ from decode's by {(logits - want_logits).abs().max().item()}"
        )


def test_without_the_mode_prefill_and_decode_differ(runners: dict[bool, ModelRunner]) -> None:
    """What the mode fixes is real on this path (else the test above would prove nothing)."""
    set_one_arithmetic(False)
    got = ways(runners[False])
    want_logits, want_kv = got["decoded alone"]
    assert not torch.equal(got["prefilled at once"][1], want_kv)
    assert not torch.equal(got["prefilled at once"][0], want_logits)


# ---------------------------------------------------------------- end to end (SGLang's test modes)

QUESTION = "Name three rivers of Europe and say which sea each reaches."
NEW_TOKENS = 20


def body(text: str, seeded: bool, max_new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    params.update({"temperature": 0.8, "top_p": 0.9, "seed": 7} if seeded else {"temperature": 0})
    return {"text": text, "sampling_params": params}


def together(server: Server, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: server.generate(b, timeout=300), bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


@pytest.fixture(scope="module")
def det_server() -> Any:
    with Server("--enable-deterministic-inference", "--max-total-tokens", "4096") as server:
        yield server


@pytest.mark.slow  # one SmolLM2 bf16 server, ~45 s
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_one_prompt_gives_one_completion_in_any_batch(det_server: Server, seeded: bool) -> None:
    check_single_mode(det_server, seeded)


@pytest.mark.slow  # one SmolLM2 bf16 server, ~45 s
def test_cached_prefixes_give_the_tokens_of_a_flushed_cache(det_server: Server) -> None:
    check_prefix_mode(det_server)


def check_single_mode(det_server: Server, seeded: bool) -> None:
    """SGLang's "single" mode: the prompt alone, then inside batches of 3 and 6 of other prompts
    (other lengths, so its rows, chunks and decode batches differ each time)."""
    assert "deterministic inference: every token on the decode kernel's arithmetic" in det_server.output()
    fillers = [
        f"Write a short line about the number {i} and its {'square ' * (i % 3)}root." for i in range(5)
    ]
    alone = together(det_server, [body(QUESTION, seeded)])[0]
    assert len(alone["output_ids"]) == NEW_TOKENS
    for size in (3, 6):
        requests.post(det_server.url + "/flush_cache", timeout=30)
        out = together(det_server, [body(f, seeded) for f in fillers[: size - 1]] + [body(QUESTION, seeded)])
        assert out[-1]["output_ids"] == alone["output_ids"], f"batch of {size}"
        assert out[-1]["text"] == alone["text"]


def check_prefix_mode(det_server: Server) -> None:
    """SGLang's "prefix" mode: a prompt whose start is in the radix cache, written by a prefill and
    (a second turn after the model's own answer) by decode steps, against the same prompt after
    /flush_cache."""
    first = together(det_server, [body(QUESTION, False)])[0]  # its answer's KV: decode-written
    second_turn = QUESTION + first["text"] + " Which of them is the longest?"
    for text in (QUESTION + " Answer briefly.", second_turn):
        cached = together(det_server, [body(text, True)])[0]
        assert cached["meta_info"]["cached_tokens"] > 0, cached["meta_info"]
        assert requests.post(det_server.url + "/flush_cache", timeout=30).status_code == 200
        flushed = together(det_server, [body(text, True)])[0]
        assert flushed["meta_info"]["cached_tokens"] == 0
        assert cached["output_ids"] == flushed["output_ids"], text
        together(det_server, [body(QUESTION, False)])  # the first turn cached again for the next text
