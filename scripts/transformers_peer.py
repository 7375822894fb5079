"""The peer side of compare_peers.py: the same workload on Hugging Face transformers, timed per request
the way bench_serving times a server's requests (seconds since the request was handed over).

- `generate`: static batches of `concurrency` prompts, left-padded, through `model.generate`; a
  streamer records when each step's tokens come out, so every request of a batch gets that batch's
  TTFT and inter-token gaps, and its end-to-end time is the batch's.
- `continuous`: transformers' own continuous batching (`generate_batch`'s manager), fed as a closed
  loop: `concurrency` requests are added, and each finished one is replaced by the next prompt.
Both are greedy and ignore EOS, so each request makes exactly `output_len` tokens.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from bench_metrics import RequestResult

MODES = ("generate", "continuous")
PAGE_SIZE = 256  # tokens per KV block of the continuous-batching cache (its default)
MAX_BATCH_TOKENS = 8192  # tokens per forward of continuous batching (its default)


def load_model(model_dir: str, dtype: torch.dtype) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def has_continuous_batching(model: Any) -> bool:
    """Whether the installed transformers has continuous batching with the API used here."""
    import transformers

    return hasattr(transformers, "ContinuousBatchingConfig") and hasattr(
        model, "continuous_batching_context_manager"
    )


def pad_token_id(model: Any) -> int:
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return int(eos) if eos is not None else 0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [batch, longest prompt], padded on the left so that every
    prompt's last token sits in the last column, where generate appends."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.int64)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.int64)
    return ids, mask


def _step_streamer() -> Any:
    from transformers.generation.streamers import BaseStreamer

    class StepTimes(BaseStreamer):
        """When generate hands over each step's new tokens (its first `put` is the prompt)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.puts = 0

        def put(self, value: torch.Tensor) -> None:
            self.puts += 1
            if self.puts > 1:
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepTimes()


@torch.inference_mode()
def generate_batch(model: Any, prompts: list[list[int]], output_len: int) -> list[RequestResult]:
    """One static batch through `generate`; raises RuntimeError if it makes other lengths."""
    pad_id = pad_token_id(model)
    ids, mask = left_pad(prompts, pad_id)
    streamer = _step_streamer()
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        min_new_tokens=output_len,
        max_new_tokens=output_len,
        pad_token_id=pad_id,
        streamer=streamer,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    latency = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + output_len or len(streamer.times) != output_len:
        raise RuntimeError(
            f"generate made {out.shape[1] - ids.shape[1]} tokens in {len(streamer.times)} steps, "
            f"not {output_len}"
        )
    chunk_times = [t - start for t in streamer.times]
    return [
        RequestResult(
            prompt_len=len(p),
            output_len=output_len,
            success=True,
            latency=latency,
            chunk_times=list(chunk_times),
            chunk_tokens=[1] * output_len,
        )
        for p in prompts
    ]


def run_generate(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
) -> tuple[list[RequestResult], float]:
    """Batches of `concurrency` prompts, one after the other; (per-request results, wall seconds)."""
    start = time.perf_counter()
    results = []
    for first in range(0, len(prompts), concurrency):
        results += generate_batch(model, prompts[first : first + concurrency], output_len)
    return results, time.perf_counter() - start


@torch.inference_mode()
def run_continuous(
    model: Any, prompts: list[list[int]], output_len: int, concurrency: int, timeout_s: float
) -> tuple[list[RequestResult], float]:
    """At most `concurrency` requests in transformers' continuous-batching manager at a time;
    (per-request results, wall seconds from the first request added to the last one finished).
    The manager's set-up and warmup run before the clock starts, as a server's start-up would.
    Raises RuntimeError when the manager stops, refuses a request, or finishes none for `timeout_s`."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=output_len, eos_token_id=-1
    )  # -1: no EOS
    # Sized to the workload: on CPU its default cache takes 60% of RAM and costs many seconds to set up.
    longest = max(len(p) for p in prompts) + output_len
    config = ContinuousBatchingConfig(
        max_requests_per_batch=concurrency,
        num_blocks=concurrency * math.ceil(longest / PAGE_SIZE) + 1,
        max_batch_tokens=max(concurrency, min(concurrency * longest, MAX_BATCH_TOKENS)),
        page_size=PAGE_SIZE,
    )
    results = [RequestResult(prompt_len=len(p)) for p in prompts]
    sent_at: dict[str, float] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=config, block=True, timeout=30
    ) as manager:

        def submit(index: int) -> None:
            request_id = f"bench-{index}"
            sent_at[request_id] = time.perf_counter()
            if (
                manager.add_request(
                    prompts[index],
                    request_id=request_id,
                    max_new_tokens=output_len,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
                is None
            ):
                raise RuntimeError(f"transformers' continuous batching refused request {index}")

        start = time.perf_counter()
        deadline = start + timeout_s
        next_index, done = min(concurrency, len(prompts)), 0
        for index in range(next_index):
            submit(index)
        while done < len(prompts):
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running() or time.perf_counter() > deadline:
                    raise RuntimeError(
                        f"transformers' continuous batching stopped, or finished nothing for "
                        f"{timeout_s} s, after {done} of {len(prompts)} requests"
                    )
                continue
            if not out.is_finished():
                continue
            index = int(out.request_id.removeprefix("bench-"))
            _record(results[index], out, sent_at[out.request_id], output_len)
            done += 1
            deadline = time.perf_counter() + timeout_s
            if next_index < len(prompts):
                submit(next_index)
                next_index += 1
        duration = time.perf_counter() - start
    return results, duration


def _record(result: RequestResult, out: Any, sent: float, output_len: int) -> None:
    stamps = list(out.timestamps or [])
    result.output_len = len(out.generated_tokens)
    result.chunk_times = [t - sent for t in stamps]
    result.chunk_tokens = [1] * len(stamps)
    result.latency = (stamps[-1] if stamps else time.perf_counter()) - sent
    if out.error is not None:
        result.error = f"transformers: {out.error}"
    elif result.output_len != output_len or len(stamps) != output_len:
        result.error = (
            f"transformers made {result.output_len} tokens ({len(stamps)} timestamps), not {output_len}"
        )
    else:
        result.success = True
