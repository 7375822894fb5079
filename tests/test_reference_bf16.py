"""The default path (bf16, the C kernels) held to transformers on the bundled SmolLM2, through the
server at TP=1 (and, in the slow tier, TP=3 and PP=2).

Per-choice loglikelihoods of a multiple-choice set, read through /v1/completions (`echo` and
`logprobs`, as lm-eval-harness reads them), must be no further from transformers' float32 than
transformers' own bf16 is, with 25% to spare: the smallest distance measured (SRT_REFERENCE_BF16_LIVE=1
computes it on this machine instead, to measure it again). Greedy tokens must equal transformers' float32 where its bf16 agrees
with its float32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
import transformers
from server_fixture import Server

# Reading comprehension: a passage of a few hundred tokens, then questions about it. The passages are
# long enough that rounding inside attention and along the residual stream shows in the answers.
PASSAGES = [
    (
        "The village of Ashford sits at the bend of a slow river, where the water turns east before it "
        "reaches the sea. For three hundred years the village lived on wool. Sheep grazed the hills "
        "to the north, and every spring the shearers came down from the uplands with their blades and "
        "their songs. The wool was washed in the river, dried on long wooden frames in the meadow, and "
        "carried by cart to the market town of Wexley, a day's journey to the south. In the year the "
        "railway arrived, everything changed. The line ran along the river bank, and a small station "
        "was built beside the old mill. Merchants no longer waited for the carts; they came by train, "
        "bought the wool at the station, and were home by evening. The mill owner, a careful woman "
        "named Edith Marsh, saw that the trains could carry more than wool. She bought two looms, "
        "then ten, and within a decade the mill was weaving cloth that was sold as far away as the "
        "capital. The shearers still came each spring, but now they stayed through the summer to work "
        "the looms, and many of them never went back to the hills. The village school, which had "
        "once had a single room, grew to four. When Edith Marsh died, she left the mill to the "
        "workers who ran it, and it is still owned by their grandchildren today.\n\n"
    ),
    (
        "Maria kept a small notebook in which she wrote down every bird she saw. On Monday she walked "
        "to the lake before breakfast and counted seven herons standing in the shallow water near the "
        "reeds. On Tuesday it rained all day, so she stayed inside and repaired the wooden feeder that "
        "hung outside the kitchen window; by the evening a pair of blue tits had already found it. On "
        "Wednesday her brother Tomas visited with his new camera. Together they climbed the hill behind "
        "the house, where Tomas photographed a buzzard circling above the pine trees while Maria "
        "sketched it in pencil. On Thursday she took the bus into town to buy a better pair of "
        "binoculars, because her old pair had a crack in the left lens. The shopkeeper, an old man who "
        "had watched birds for fifty years, told her that the best time to see owls was an hour after "
        "sunset, in the first week of winter. On Friday night she went out with the new binoculars and "
        "a flask of tea, waited by the barn for an hour, and finally saw a barn owl gliding silently "
        "over the field. She wrote it down in the notebook with a small star beside it, the first star "
        "she had ever drawn there.\n\n"
    ),
    (
        "A computer program that adds two numbers must first read them from memory. Modern processors "
        "keep a small amount of very fast memory, called a cache, close to each core. When the program "
        "asks for a number, the processor looks in the cache first; if the number is there, it arrives "
        "in a few cycles. If it is not, the processor must fetch it from main memory, which can take a "
        "hundred times longer. For this reason, programs that read memory in order, one address after "
        "the next, run much faster than programs that jump around: the processor notices the pattern "
        "and fetches the next numbers before they are needed. Large language models spend most of "
        "their time reading their weights from memory, so the speed at which memory can be read, "
        "called the bandwidth, often decides how quickly they can produce each word. Engineers "
        "therefore try to read every weight only once per step and to keep the numbers small: a "
        "weight stored in sixteen bits takes half the time to read of one stored in thirty-two bits, "
        "and a weight stored in four bits takes a quarter of that again.\n\n"
    ),
]
QUESTIONS = [
    (0, "Question: What did the village of Ashford live on before the railway came?\nAnswer:",
     [" wool", " fishing", " coal", " wine"]),
    (0, "Question: Who owned the mill when the railway arrived?\nAnswer:",
     [" Edith Marsh", " the shearers", " the merchants of Wexley", " the railway company"]),
    (0, "Question: Where was the market town?\nAnswer:",
     [" a day's journey to the south", " across the sea", " in the northern hills", " beside the station"]),
    (0, "Question: Who owns the mill today?\nAnswer:",
     [" the grandchildren of its workers", " the railway", " the village school", " a bank in the capital"]),
    (1, "Question: How many herons did Maria count on Monday?\nAnswer:",
     [" seven", " two", " twelve", " none"]),
    (1, "Question: What did Tomas photograph from the hill?\nAnswer:",
     [" a buzzard", " a heron", " an owl", " a blue tit"]),
    (1, "Question: Why did Maria buy new binoculars?\nAnswer:",
     [" her old pair had a cracked lens", " she lost her old pair", " Tomas broke them", " they were on sale"]),
    (1, "Question: Which bird did Maria see on Friday night?\nAnswer:",
     [" a barn owl", " a heron", " a buzzard", " a swan"]),
    (2, "Question: Where does a processor look first for a number?\nAnswer:",
     [" in the cache", " on the disk", " in the network", " in the keyboard"]),
    (2, "Question: Why do programs that read memory in order run faster?\nAnswer:",
     [" the processor fetches the next numbers early", " they use less power",
      " they have fewer bugs", " the memory is smaller"]),
    (2, "Question: What often decides how quickly a language model produces each word?\nAnswer:",
     [" memory bandwidth", " the screen size", " the keyboard", " the font"]),
    (2, "Question: How long does a sixteen-bit weight take to read compared with a thirty-two-bit one?\nAnswer:",
     [" half the time", " twice the time", " the same time", " ten times longer"]),
]  # fmt: skip
GREEDY_PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The capital of Japan is",
]
GREEDY_TOKENS = 16
# Greedy tokens are compared up to the first near-tie of float32's own choice: where its top two
# logprobs are this close, a last-bit difference may pick either (SmolLM2 on "The three primary
# colours are" has ':' and ',' 0.008 nats apart at its 8th token, and transformers' bf16 picks ',').
TIE_NATS = 0.02
MARGIN = 1.25  # the issue's bound for the choices: within transformers' own bf16 distance x 1.25
# Every prompt token's logprob, averaged over the set's ~4,000: where the default path rounds less
# than transformers' bf16 (the float32 residual stream, row-parallel sums and logits), it is well
# nearer float32. Measured at TP=1: 0.46x; before those, 0.98x (docs/performance.md).
TOKEN_MARGIN = 0.75

# transformers bf16's distances from its float32 on this set (choices, tokens), the smallest measured
# by this test's live computation: AMD Zen 4 0.0893 / 0.0366 (12-04), AMD Zen 3 0.1033 / 0.0369 (12-04).
# Computing them takes minutes where torch has no bf16 matmul kernel (AVX2): SRT_REFERENCE_BF16_LIVE=1.
BF16_MEASURED = (0.0893, 0.0366)
LIVE_BF16 = os.environ.get("SRT_REFERENCE_BF16_LIVE") == "1"

ServerArgs = tuple[str, ...]
LAYOUTS: dict[str, ServerArgs] = {
    "tp1": (),
    "tp3": ("--tp-size", "3"),
    "pp2": ("--pp-size", "2"),
}


class Reference:
    """transformers on the same weights, in float32 and bf16: each choice's token logprobs (from
    which its loglikelihood sums) and greedy continuations."""

    def __init__(self, model_dir: Path) -> None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.choices: list[tuple[list[int], int]] = []  # (context + choice ids, context length)
        for passage, question, options in QUESTIONS:
            context = PASSAGES[passage] + question
            context_ids = tokenizer(context)["input_ids"]
            for option in options:
                ids = tokenizer(context + option)["input_ids"]
                assert ids[: len(context_ids)] == context_ids, (context, option)
                self.choices.append((ids, len(context_ids)))
        self.prompts = [tokenizer(p)["input_ids"] for p in GREEDY_PROMPTS]
        self.model_dir = model_dir
        self.token_logprobs: dict[torch.dtype, list[torch.Tensor]] = {}
        self.greedy: dict[torch.dtype, list[list[int]]] = {}
        self.tie_at: list[
            int
        ] = []  # per prompt: float32's first near-tie in its greedy tokens (or their count)
        for dtype in (torch.float32, torch.bfloat16):
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            with torch.no_grad():
                if dtype == torch.float32:  # bf16's are costly where torch has no bf16 matmul: bf16_distances
                    self.token_logprobs[dtype] = [
                        row for i in range(0, len(self.choices), 4) for row in self._token_logprobs(model, i)
                    ]
                self.greedy[dtype] = [
                    model.generate(torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False)[
                        0, len(p) :
                    ].tolist()
                    for p in self.prompts
                ]
                if dtype == torch.float32:
                    self.tie_at = [
                        self._first_tie(model, p, g) for p, g in zip(self.prompts, self.greedy[dtype])
                    ]

    def bf16_distances(self) -> tuple[float, float]:
        """transformers bf16's own distances from its float32 (computed once, on first use)."""
        if torch.bfloat16 not in self.token_logprobs:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=torch.bfloat16
            ).eval()
            with torch.no_grad():
                self.token_logprobs[torch.bfloat16] = [
                    row for i in range(0, len(self.choices), 4) for row in self._token_logprobs(model, i)
                ]
        return self.distances(self.token_logprobs[torch.bfloat16])

    @staticmethod
    def _first_tie(model: Any, prompt: list[int], greedy: list[int]) -> int:
        """The first position of `greedy` where the model's top two logprobs are within TIE_NATS."""
        logprobs = torch.log_softmax(model(torch.tensor([prompt + greedy])).logits[0].float(), -1)
        top = torch.topk(logprobs[len(prompt) - 1 : len(prompt) - 1 + len(greedy)], 2).values
        close = ((top[:, 0] - top[:, 1]) < TIE_NATS).nonzero()
        return int(close[0, 0]) if len(close) else len(greedy)

    def _token_logprobs(self, model: Any, first: int) -> list[torch.Tensor]:
        """A question's choices in one forward, padded on the right (causal: no position sees the
        pad): each choice's logprobs of its tokens 1.. given those before."""
        group = self.choices[first : first + 4]
        width = max(len(ids) for ids, _ in group)
        batch = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in group])
        logprobs = torch.log_softmax(model(batch).logits.float(), -1)
        return [
            logprobs[row, : len(ids) - 1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            for row, (ids, _) in enumerate(group)
        ]

    def loglikelihoods(self, token_logprobs: list[torch.Tensor]) -> torch.Tensor:
        """Each choice's summed logprobs of its continuation tokens."""
        return torch.stack([lp[n - 1 :].sum() for lp, (_, n) in zip(token_logprobs, self.choices)])

    def distances(self, token_logprobs: list[torch.Tensor]) -> tuple[float, float]:
        """(mean |loglikelihood - float32's| over the choices, mean |token logprob - float32's| over
        every prompt token), in nats."""
        ref = self.token_logprobs[torch.float32]
        choices = (self.loglikelihoods(token_logprobs) - self.loglikelihoods(ref)).abs().mean()
        tokens = (torch.cat(token_logprobs) - torch.cat(ref)).abs().mean()
        return float(choices), float(tokens)


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Reference:
    return Reference(smollm2_dir)


def served_token_logprobs(server: Server, choices: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Each choice's prompt token logprobs (tokens 1..), read back from the echoed prompt of
    /v1/completions as lm-eval-harness reads them, one request per question (its four choices)."""
    out: list[torch.Tensor] = []
    for i in range(0, len(choices), 4):
        group = choices[i : i + 4]
        body = {
            "prompt": [ids for ids, _ in group],
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        }
        response = requests.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answers = sorted(response.json()["choices"], key=lambda c: c["index"])
        for (ids, _), answer in zip(group, answers):
            token_logprobs = answer["logprobs"]["token_logprobs"]
            assert token_logprobs[0] is None and len(token_logprobs) == len(ids) + 1  # the prompt, then 1 new
            out.append(torch.tensor(token_logprobs[1 : len(ids)]))
    return out


def served_greedy(server: Server, prompts: list[list[int]]) -> list[list[int]]:
    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True},
    }
    response = server.generate(body)
    assert response.status_code == 200, response.text
    return [out["output_ids"] for out in response.json()]


@pytest.mark.parametrize(
    "layout",
    # TP=3 and PP=2 take 90 s between them: the slow tier (CI runs it) holds them
    [layout if layout == "tp1" else pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS],
)
def test_default_path_is_held_to_transformers(layout: str, reference: Reference, smollm2_dir: Path) -> None:
    with Server(*LAYOUTS[layout], "--cpu-kvcache-space", "0.25") as server:
        served = served_token_logprobs(server, reference.choices)
        greedy = served_greedy(server, reference.prompts)
    choices, tokens = reference.distances(served)
    bf16_choices, bf16_tokens = reference.bf16_distances() if LIVE_BF16 else BF16_MEASURED
    print(
        f"{layout}: choices {choices:.4f} tokens {tokens:.4f}; transformers bf16 {bf16_choices:.4f} {bf16_tokens:.4f}"
    )
    assert choices <= MARGIN * bf16_choices, (
        f"{layout}: the choices' loglikelihoods are {choices:.4f} nats from transformers float32 on "
        f"average, transformers bf16's {bf16_choices:.4f} (bound x{MARGIN})"
    )
    assert tokens <= TOKEN_MARGIN * bf16_tokens, (
        f"{layout}: prompt tokens' logprobs are {tokens:.4f} nats from transformers float32 on average, "
        f"transformers bf16's {bf16_tokens:.4f} (bound x{TOKEN_MARGIN})"
    )
    agreed = [
        i
        for i, (fp32, bf16) in enumerate(
            zip(reference.greedy[torch.float32], reference.greedy[torch.bfloat16])
        )
        if fp32 == bf16
    ]
    assert len(agreed) >= len(GREEDY_PROMPTS) // 2, (
        "too few prompts where transformers' bf16 keeps float32's tokens"
    )
    for i in agreed:
        tie = reference.tie_at[i]
        assert greedy[i][:tie] == reference.greedy[torch.float32][i][:tie], (
            f"{layout}: {GREEDY_PROMPTS[i]!r} diverged before float32's first near-tie (token {tie})"
        )
