"""`launch_server --speculative-algorithm NGRAM` on the default path (bundled SmolLM2, bf16, the CPU
kernels): a client gets the tokens and logprobs plain decoding gives, at TP=1 (against the offline
engine) and, in the slow tier, at TP=3 (deterministic inference on) and PP=2 (against the same layout
without speculation), and STANDALONE (a draft model) at TP=3;
/metrics and the decode log line show the accept length."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import Server
from test_speculative import LIST_PROMPT, OTHER_PROMPT

from model_executor.cpu.kernels import build
from srt.default_model import default_model_path
from srt.engine import Engine
from srt.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.kernels() is None, reason="the CPU kernels did not build here")

ACCEPT_LINE = re.compile(r"Decode batch\. .*token usage: \d\.\d\d, accept len: (\d+\.\d\d), gen throughput")


def payloads() -> list[dict[str, Any]]:
    """Greedy and seeded requests on a prompt whose answer repeats it, and one on another prompt,
    each with logprobs."""
    out = []
    for i, params in enumerate(
        [
            {"temperature": 0},
            {"temperature": 0.7, "seed": 5},
            {"temperature": 0, "frequency_penalty": 0.2},
            {"temperature": 0.9, "top_k": 20, "seed": 9},
        ]
    ):
        out.append(
            {
                "input_ids": LIST_PROMPT if i < 3 else OTHER_PROMPT,
                "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, **params},
                "return_logprob": True,
            }
        )
    return out


def generate_all(server: Server) -> list[dict[str, Any]]:
    """The payloads as one batch request, so every run admits them in the same step (at TP > 1 a
    prefill's all-reduce sums in an order that can follow the batch's size)."""
    bodies = payloads()
    batch = {
        "input_ids": [b["input_ids"] for b in bodies],
        "sampling_params": [b["sampling_params"] for b in bodies],
        "return_logprob": True,
    }
    reply = server.generate(batch, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def test_served_tokens_equal_plain_decoding_and_the_accept_length_is_shown(smollm2_dir: Path) -> None:
    with Server(
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16",
        "--enable-metrics", "--decode-log-interval", "4",
    ) as server:  # fmt: skip
        got = generate_all(server)
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        log = server.output()
    engine = Engine(None)  # the same default path, in this process, without speculation
    want = engine.generate(
        [b["input_ids"] for b in payloads()],
        [SamplingParams.from_dict(b["sampling_params"]) for b in payloads()],
    )
    for g, w in zip(got, want):
        assert g["output_ids"] == w.output_ids
    accept = [float(m[1]) for m in map(ACCEPT_LINE.search, log.splitlines()) if m]
    assert accept and max(accept) > 1.0, log[-3000:]
    gauge = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert gauge.get("srt:spec_accept_length", 0) > 1.0


NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16")


STANDALONE = ("--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "5")


@pytest.mark.slow  # five servers of three ranks or two stages (the TP=1 test above runs by default)
# At TP >= 3 speculation sums the all-reduces in rank order (a ring's order follows the step's
# size), which plain decoding does only with deterministic inference: every side runs it there.
# STANDALONE drafts with the bundled model's own GGUF file (the launcher converts it as it does
# --model-path): its drafts are mostly taken, and at TP=3 MIN-synced before any rank verifies them.
@pytest.mark.parametrize(
    ("layout", "specs"),
    [
        (("--tp", "3", "--enable-deterministic-inference"), (NGRAM, STANDALONE)),
        (("--pp-size", "2"), (NGRAM,)),
    ],
    ids=["tp3", "pp2"],
)
def test_tp_and_pp_tokens_and_logprobs_equal_without_speculation(
    layout: tuple[str, ...], specs: tuple[tuple[str, ...], ...]
) -> None:
    with Server(*layout, startup_timeout=300) as server:
        off = generate_all(server)
    for spec in specs:
        if "STANDALONE" in spec:
            spec = (*spec, "--speculative-draft-model-path", default_model_path())
        flags = (*spec, "--enable-rank-consensus-checker", "--decode-log-interval", "4")
        with Server(*layout, *flags, startup_timeout=300) as server:
            on = generate_all(server)
            log = server.output()
        for a, b in zip(on, off):
            assert a["output_ids"] == b["output_ids"], spec
            assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"], spec
        accept = [float(m[1]) for m in map(ACCEPT_LINE.search, log.splitlines()) if m]
        assert accept and max(accept) > 1.0, log[-3000:]
