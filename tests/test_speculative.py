"""--speculative-algorithm NGRAM never changes an output: on the default path (SmolLM2, bf16, the CPU
kernels) a request gets the same tokens and logprobs with speculation on as off, greedy or seeded,
with penalties, stops inside a draft, a grammar beside it, and the pipeline loop; drafts are
accepted on text that repeats; rejected drafts' KV goes back to the allocator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scheduler_harness import Harness
from tiny_models import make_tiny_model
from transformers import AutoTokenizer

from model_executor.cpu.kernels import build, ops
from model_executor.draft_model import DraftModel
from model_executor.drafter import Drafter
from scheduler.drafts import ModelDrafts, NgramDrafts, NgramState, ngram_draft
from scheduler.speculative import accepted_tokens
from srt.io_struct import BatchTokenIDOut, TokenizedGenerateReq
from srt.sampling_params import SamplingParams
from srt.server_args import ServerArgs

# SmolLM2's chat template around "Copy this list exactly: apples, pears, ..." (its answer repeats it)
LIST_PROMPT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 32601, 451, 1398, 3869, 42, 13855, 28, 41684, 28, 475, 6245,
    28, 38702, 28, 8151, 28, 303, 1014, 28, 501, 17493, 271, 28, 18214, 28, 5002, 707, 28, 34526,
    28, 13855, 28, 41684, 28, 475, 6245, 28, 38702, 30, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip
LIST_REGEX = r"Here is the list[a-z ]*: [a-z]+(, [a-z]+)*\."  # the answer, up to its period
OTHER_PROMPT = [1, 504, 3458, 314, 260, 3656, 282, 4722, 30, 378, 2151, 288, 260, 15661, 282, 253, 1789, 29]


def test_ngram_draft_takes_the_longest_most_recent_match() -> None:
    tokens = [5, 8, 1, 2, 3, 9, 8, 1, 2, 4, 7, 8, 1, 2]
    # suffix (8, 1, 2): matched at positions 1-3 and 6-8 (3 tokens each): the most recent wins
    assert ngram_draft(tokens, NgramState(), 3, 18) == [4, 7, 8]
    tokens = [7, 8, 1, 2, 3, 6, 9, 8, 1, 2, 4, 7, 8, 1, 2]
    assert ngram_draft(tokens, NgramState(), 2, 18) == [3, 6]  # (7, 8, 1, 2) beats (8, 1, 2)
    assert ngram_draft(tokens, NgramState(), 2, 3) == [4, 7]  # at most 3 matched: the most recent
    assert ngram_draft([1, 2, 3, 9, 2, 3], NgramState(), 4, 18) == []  # 2 tokens are not enough
    assert ngram_draft(tokens, NgramState(), 0, 18) == []


def test_ngram_index_grows_with_the_tokens() -> None:
    state, tokens = NgramState(), [1, 2, 3, 1, 2]
    assert ngram_draft(tokens, state, 4, 18) == []
    tokens += [3]
    assert ngram_draft(tokens, state, 4, 18) == [1, 2, 3]
    assert state.indexed == len(tokens) - 1


def test_accepted_tokens() -> None:
    assert accepted_tokens([], [7]) == [7]
    assert accepted_tokens([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]
    assert accepted_tokens([4, 5, 6], [3, 5, 6, 1]) == [3]


def test_draft_lengths_follow_acceptance() -> None:
    spec = NgramDrafts(num_draft_tokens=9, max_match=18)

    class R:
        rid, grammar, remaining_new_tokens, seq_len = "r", None, 100, 10
        fill_ids = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]

    req: Any = R()
    assert spec.drafts([req], 4096) == [[4, 5, 6, 7, 8, 1, 2, 3]]
    spec.verified(req, [4, 5, 6, 7, 8, 1, 2, 3], 3)  # 2 accepted: the next drafts at most 3
    assert spec.states["r"].max_drafts == 3
    assert spec.drafts([req], 4096) == [[4, 5, 6]]
    spec.verified(req, [4, 5, 6], 1)  # a miss: 2 steps without drafts
    assert [spec.drafts([req], 4096) for _ in range(3)] == [[[]], [[]], [[4]]]
    other: Any = R()
    other.rid = "s"
    # 9 rows at most: two requests and 7 drafts, the first request's
    assert spec.drafts([other, req], 4096) == [[4, 5, 6, 7, 8, 1, 2], []]
    req.remaining_new_tokens = 1  # the last token: nothing to draft
    spec.states["r"].max_drafts = 8
    assert spec.drafts([req], 4096) == [[]]


def test_a_draft_model_is_reached_by_rows_and_token_lists() -> None:
    """STANDALONE's requests each take a row of the drafter when they first draft, draft through it
    with their tokens within the step's budget, and give it back when they finish; with no row free
    a request drafts nothing."""

    class OneRow(Drafter):
        context_length = 4096

        def __init__(self) -> None:
            self.free, self.calls = [0], []

        def open_row(self) -> int | None:
            return self.free.pop() if self.free else None

        def close_row(self, row: int) -> None:
            self.free.append(row)

        def draft(self, rows: list[int], tokens: list[list[int]], lengths: list[int]) -> list[list[int]]:
            self.calls.append((rows, [len(t) for t in tokens], lengths))
            return [[7] * n for n in lengths]

    class R:
        grammar, remaining_new_tokens, seq_len, fill_ids = None, 100, 10, list(range(10))

        def __init__(self, rid: str) -> None:
            self.rid = rid

    drafter = OneRow()
    source = ModelDrafts(drafter, num_draft_tokens=5)
    a: Any = R("a")
    b: Any = R("b")
    # 5 rows a step: two requests and 3 drafts, the first request's
    assert source.drafts([a, b], 4096) == [[7, 7, 7], []]
    assert drafter.calls == [([0], [10], [3])]
    assert source.drafts([b], 4096) == [[]]  # the one row is a's
    source.forget("a")
    assert drafter.free == [0]
    assert source.drafts([b], 4096) == [[7, 7, 7, 7]] and drafter.calls[-1] == ([0], [10], [4])


def test_flags_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE is not implemented"):
        ServerArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="--speculative-ngram-max-bfs-breadth 4 is not supported"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=4)
    with pytest.raises(ValueError, match="--speculative-accept-threshold-single"):
        ServerArgs(speculative_accept_threshold_single=0.5)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be positive"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0)
    assert ServerArgs(speculative_algorithm="NGRAM").num_draft_tokens == 4


def test_draft_model_flags_refused_by_name() -> None:
    with pytest.raises(ValueError, match="STANDALONE needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="--speculative-draft-model-path steps a draft model"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_draft_model_path="/m")
    with pytest.raises(ValueError, match="--speculative-num-steps steps a draft model"):
        ServerArgs(speculative_num_steps=3)
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2 is not supported"):
        ServerArgs(
            speculative_algorithm="STANDALONE", speculative_draft_model_path="/m", speculative_eagle_topk=2
        )
    with pytest.raises(
        ValueError, match="--speculative-num-draft-tokens 5 must be --speculative-num-steps \\+ 1"
    ):
        ServerArgs(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path="/m",
            speculative_num_steps=3,
            speculative_num_draft_tokens=5,
        )
    with pytest.raises(ValueError, match="STANDALONE runs with --pp-size 1"):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="/m", pp_size=2)
    with pytest.raises(ValueError, match="EAGLE3 is not implemented"):
        ServerArgs(speculative_algorithm="EAGLE3")
    standalone = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/m"}
    assert ServerArgs(**standalone, speculative_num_steps=5, speculative_eagle_topk=1).num_draft_tokens == 6
    # the draft's quantization: SGLang's default is the target's; "unquant" none
    assert ServerArgs(**standalone, quantization="gguf").draft_quantization == "gguf"
    unquant = ServerArgs(**standalone, quantization="gguf", speculative_draft_model_quantization="unquant")
    assert unquant.draft_quantization is None and ServerArgs(**standalone).draft_quantization is None
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization must be one of"):
        ServerArgs(**standalone, speculative_draft_model_quantization="awq")
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization steps a draft model"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_draft_model_quantization="gguf")
    assert ServerArgs(**standalone).num_draft_tokens == 4


class Run:
    """One in-process scheduler on SmolLM2 bf16; each request's tokens, finish and logprobs."""

    def __init__(self, model_dir: Path, spec: bool, **args: Any) -> None:
        self.h = Harness(
            model_dir,
            dtype="bfloat16",
            eos_token_ids=frozenset({2}),
            tokenizer_loader=lambda: AutoTokenizer.from_pretrained(model_dir),
            **{
                # room for every request's drafts; `args` may name another algorithm
                **({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 96} if spec else {}),
                **args,
            },
        )
        self.logprobs: dict[str, list[float]] = {}
        self.tops: dict[str, list[Any]] = {}
        collect = self.h._collect

        def collect_logprobs() -> None:
            for out in self.h.outputs:
                if isinstance(out, BatchTokenIDOut):
                    for rid, lp in zip(out.rids, out.output_logprobs):
                        if lp is not None:
                            self.logprobs.setdefault(rid, []).extend(lp.values)
                            self.tops.setdefault(rid, []).extend(lp.top)
            collect()

        self.h._collect = collect_logprobs  # type: ignore[method-assign]

    def run(self, requests: list[tuple[str, list[int], SamplingParams, dict[str, Any]]]) -> dict[str, Any]:
        for rid, ids, params, extra in requests:
            self.h.send(TokenizedGenerateReq(rid, ids, params, seed=11, **extra))
        steps = self.h.scheduler.forward_steps
        self.h.run_until_idle()
        assert self.h.integrity_error() is None
        return {
            "tokens": dict(self.h.tokens),
            "finished": {rid: (r.type, r.matched) for rid, r in self.h.finished.items()},
            "logprobs": self.logprobs,
            "tops": self.tops,
            "steps": self.h.scheduler.forward_steps - steps,
        }


REQUESTS = [
    ("greedy", LIST_PROMPT, SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True), {}),
    ("seeded", LIST_PROMPT, SamplingParams(max_new_tokens=50, temperature=0.7, top_p=0.9), {}),
    (
        "penalties",
        LIST_PROMPT,
        SamplingParams(max_new_tokens=40, temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.1),
        {},
    ),
    (
        "logprobs",
        LIST_PROMPT,
        SamplingParams(max_new_tokens=30, temperature=0.0),
        {"return_logprob": True, "top_logprobs_num": 2},
    ),
    ("stop", LIST_PROMPT, SamplingParams(max_new_tokens=60, temperature=0.0, stop=["plums, figs"]), {}),
    ("min_new", LIST_PROMPT, SamplingParams(max_new_tokens=33, min_new_tokens=20, temperature=0.0), {}),
    ("other", OTHER_PROMPT, SamplingParams(max_new_tokens=40, temperature=0.0), {}),
    (
        "regex",
        OTHER_PROMPT,
        SamplingParams(max_new_tokens=20, temperature=0.0, regex="(yes|no)[a-z ]{0,30}"),
        {},
    ),
    ("regex_list", LIST_PROMPT, SamplingParams(max_new_tokens=64, temperature=0.0, regex=LIST_REGEX), {}),
]

pytestmark = pytest.mark.skipif(build.kernels() is None, reason="the CPU kernels did not build here")


@pytest.mark.parametrize("micro_batches", [0, 2], ids=["one_stage", "pipeline_loop"])
def test_outputs_equal_with_speculation_off(smollm2_dir: Path, micro_batches: int) -> None:
    off = Run(smollm2_dir, spec=False, micro_batches=micro_batches).run(REQUESTS)
    on_run = Run(smollm2_dir, spec=True, micro_batches=micro_batches)
    on = on_run.run(REQUESTS)
    assert on["tokens"] == off["tokens"]
    assert on["finished"] == off["finished"]
    assert on["logprobs"] == off["logprobs"] and len(on["logprobs"]["logprobs"]) == 30
    assert on["tops"] == off["tops"]
    assert on["finished"]["stop"] == ("stop", "plums, figs")
    # drafts were taken: fewer steps for the same tokens
    assert on["steps"] < 0.9 * off["steps"], (on["steps"], off["steps"])
    assert on_run.h.scheduler.speculator is not None and not on_run.h.scheduler.speculator.source.states


@pytest.mark.skipif(
    not ops.gguf_rows_exact(), reason="the GGUF block kernels take every row count alike only on AVX-512 BF16"
)
def test_outputs_equal_with_speculation_off_on_the_gguf_blocks(smollm2_dir: Path) -> None:
    """--quantization gguf (the bundled file's Q4_1 layers and Q8_0 head on their blocks) where its
    kernels give a row the same bits in any batch: a verify step's rows are plain decode's, so the
    same tokens, finishes and logprobs with NGRAM as without."""
    off = Run(smollm2_dir, spec=False, quantization="gguf").run(REQUESTS)
    on = Run(smollm2_dir, spec=True, quantization="gguf").run(REQUESTS)
    assert on["tokens"] == off["tokens"] and on["finished"] == off["finished"]
    assert on["logprobs"] == off["logprobs"] and on["tops"] == off["tops"]
    assert on["steps"] < 0.9 * off["steps"], (on["steps"], off["steps"])


@pytest.mark.skipif(
    not ops.gguf_rows_exact(), reason="the GGUF block kernels take every row count alike only on AVX-512 BF16"
)
def test_a_draft_model_on_the_gguf_blocks_keeps_outputs_unchanged(smollm2_dir: Path) -> None:
    """STANDALONE with --quantization gguf: the draft model runs on the file's blocks too (SGLang's
    default for --speculative-draft-model-quantization), and the target's tokens, finishes and
    logprobs are plain decoding's on the same blocks."""
    requests = [r for r in REQUESTS if r[0] in ("greedy", "logprobs", "stop")]
    off = Run(smollm2_dir, spec=False, quantization="gguf").run(requests)
    on_run = Run(
        smollm2_dir,
        spec=False,
        quantization="gguf",
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(smollm2_dir),
    )
    on = on_run.run(requests)
    assert on["tokens"] == off["tokens"] and on["finished"] == off["finished"]
    assert on["logprobs"] == off["logprobs"] and on["tops"] == off["tops"]
    speculator = on_run.h.scheduler.speculator
    assert speculator is not None and isinstance(speculator.source, ModelDrafts)
    drafter = speculator.source.drafter
    assert isinstance(drafter, DraftModel) and drafter.runner.config.quantization == "gguf"
    assert on["steps"] < 0.7 * off["steps"], (on["steps"], off["steps"])


@pytest.mark.slow  # builds the AVX2 kernels (about a minute; the CI's kernel loop reuses them)
def test_speculation_on_gguf_blocks_is_refused_where_a_batch_changes_their_bits(smollm2_dir: Path) -> None:
    """On the AVX2 paths (forced here) a row's sums depend on the rows beside it: the rank refuses
    speculation with --quantization gguf at start-up, naming both flags, rather than change outputs."""
    code = (
        "import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']\n"
        "from test_speculative import Run\n"
        "Run(Path(sys.argv[2]), spec=True, quantization='gguf')\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code, str(root), str(smollm2_dir)],
        env={**os.environ, "SRT_CPU_KERNEL_ISA": "avx2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "--speculative-algorithm cannot keep outputs unchanged with --quantization gguf" in done.stderr, (
        done.stderr[-2000:]
    )


def test_a_constrained_request_takes_drafts_its_grammar_allows(smollm2_dir: Path) -> None:
    """Its drafts' rows are masked by forks of its matcher; the request's own matcher advances on
    the tokens taken only, and it ends as its grammar does, as without speculation."""
    request = [r for r in REQUESTS if r[0] == "regex_list"]
    off = Run(smollm2_dir, spec=False).run(request)
    on = Run(smollm2_dir, spec=True).run(request)
    assert on["tokens"] == off["tokens"] and on["finished"] == off["finished"]
    assert on["finished"]["regex_list"][0] == "stop" and len(on["tokens"]["regex_list"]) > 20
    assert on["steps"] < 0.7 * off["steps"], (on["steps"], off["steps"])


def test_a_draft_model_drafts_and_outputs_equal_with_speculation_off(smollm2_dir: Path) -> None:
    """--speculative-algorithm STANDALONE with SmolLM2 as its own draft model: greedy drafts that
    verification mostly takes (a seeded request's less often), the same tokens, finishes and
    logprobs as without speculation, and every draft page and row free again at the end."""
    requests = [r for r in REQUESTS if r[0] in ("greedy", "seeded", "logprobs", "stop", "regex_list")]
    off = Run(smollm2_dir, spec=False).run(requests)
    on_run = Run(
        smollm2_dir,
        spec=False,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(smollm2_dir),
        speculative_num_draft_tokens=12,
    )
    on = on_run.run(requests)
    assert on["tokens"] == off["tokens"] and on["finished"] == off["finished"]
    assert on["logprobs"] == off["logprobs"] and on["tops"] == off["tops"]
    assert on["steps"] < 0.7 * off["steps"], (on["steps"], off["steps"])
    speculator = on_run.h.scheduler.speculator
    assert speculator is not None and isinstance(speculator.source, ModelDrafts)
    assert not speculator.source.states
    drafter = speculator.source.drafter
    assert isinstance(drafter, DraftModel) and not drafter.rows
    memory = drafter.memory
    assert memory.allocator.num_free_pages == memory.budget.num_pages
    assert memory.req_to_token_pool.num_free == on_run.h.scheduler.runner.max_running_requests


def test_draft_model_drafts_are_min_synced_over_tp_and_cut_at_the_vocabulary() -> None:
    """Ranks whose draft models drafted differently (another CPU's arithmetic) verify the same rows:
    the drafts' MIN over TP; a drafted id outside the target's vocabulary ends a request's drafts."""

    class OtherRank:  # a TP group of two whose other rank drafted `theirs`
        world_size = 2

        def __init__(self, theirs: list[list[int]]) -> None:
            self.theirs = theirs

        def all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
            assert op == torch.distributed.ReduceOp.MIN
            for i, draft in enumerate(self.theirs):
                tensor[i, : len(draft)] = torch.minimum(tensor[i, : len(draft)], torch.tensor(draft))
            return tensor

    drafter = DraftModel.__new__(DraftModel)
    drafter.tp = OtherRank([[5, 9, 7], [], [3, 200]])  # type: ignore[assignment]
    drafter.vocab_size = 100
    drafter.runner = SimpleNamespace(device=torch.device("cpu"))  # type: ignore[assignment]
    assert drafter._agreed([[5, 8, 9], [], [4, 160]]) == [[5, 8, 7], [], [3]]
    drafter.tp = OtherRank([[150, 1]])  # type: ignore[assignment]
    assert drafter._agreed([[150, 1]]) == [[]]


def test_gemma3_windowed_layers_give_the_same_tokens_with_speculation(tmp_path: Path) -> None:
    """Gemma 3's post-norm layers, one of them within a 16-token window (the bench's second model,
    Gemma-3-270M, has windows of 512): drafts verified while the window slides over the prompt and
    the answer give plain decoding's tokens, greedy and seeded, and drafts are taken."""
    model_dir = make_tiny_model("gemma3", tmp_path / "gemma3")
    pattern = [5, 17, 42, 99, 7, 63, 28, 150]
    prompts = {"short": pattern * 2, "long": pattern * 5}  # 16 and 40 tokens: inside and past the window
    requests = [
        (f"{name}_{kind}", ids, params, {})
        for name, ids in prompts.items()
        for kind, params in (
            ("greedy", SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)),
            ("seeded", SamplingParams(max_new_tokens=48, temperature=0.8, ignore_eos=True)),
        )
    ]
    off = Run(model_dir, spec=False).run(requests)
    on_run = Run(model_dir, spec=True)
    on = on_run.run(requests)
    assert on["tokens"] == off["tokens"] and on["finished"] == off["finished"]
    stats = on_run.h.scheduler.stats
    assert stats.taken_total > stats.verified_total  # drafts taken (the greedy answers end in a loop)
