"""Log-probabilities of chosen tokens, and the most likely alternatives, from one step's logits.

They are the log-softmax of the model's raw float32 logits: temperature, top-k/top-p and min-p
do not change them (SGLang's default). Callers pass only the rows that asked for logprobs, so a
step in which no request asked never computes a log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TopLogprobs = tuple[list[float], list[int]]  # (logprobs, token ids), most likely first


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    top_nums: Sequence[int],
    id_lists: Sequence[list[int] | None] = (),
) -> tuple[list[float], list[TopLogprobs | None], list[TopLogprobs | None]]:
    """logits [m, vocab], token_ids [m] -> (log p(token_ids[i]) per row, the top_nums[i] best
    (logprob, id) pairs per row or None for a row that asked for none, the (logprobs, ids) of
    id_lists[i] per row in its order or None; the last is empty when id_lists is)."""
    assert logits.dim() == 2 and logits.shape[0] == token_ids.shape[0] == len(top_nums), (
        logits.shape,
        token_ids.shape,
        len(top_nums),
    )
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    floor = torch.finfo(torch.float32).min  # a -inf logprob (a -inf logit) is not valid JSON
    chosen = logprobs.gather(1, token_ids.to(torch.int64)[:, None]).squeeze(1).clamp(min=floor).tolist()
    asked: list[TopLogprobs | None] = [
        None if ids is None else (logprobs[row, ids].clamp(min=floor).tolist(), list(ids))
        for row, ids in enumerate(id_lists)
    ]
    k = min(max(top_nums, default=0), logprobs.shape[1])
    if k == 0:
        return chosen, [None] * len(top_nums), asked
    values, ids = logprobs.topk(k, dim=-1)  # sorted, most likely first
    tops: list[TopLogprobs | None] = [
        (v[:n], i[:n]) if n > 0 else None
        for v, i, n in zip(values.clamp(min=floor).tolist(), ids.tolist(), top_nums)
    ]
    return chosen, tops, asked
