"""Admission: which waiting requests join the next prefill batch, and how much of each.

Deterministic by construction: it reads only the waiting queue (in arrival order), the running
count and pool counters that every rank derived identically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.req import Req

# A running request is expected to still need about this share of its remaining max_new_tokens.
# Admission reserves that much KV; it decays while decoding goes well and jumps back up after a
# retraction (SGLang's new_token_ratio), trading admission eagerness against retraction churn.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CAP_PER_REQ = 4096


def order_waiting(
    waiting: list[Req], policy: str, prefix_len_of: Callable[[Req], int], priority_first: int = 0
) -> list[Req]:
    """fcfs: arrival order. lpm: longest cached prefix first (stable, so ties keep arrival order).
    priority_first (--enable-priority-scheduling): 1 puts larger `priority` values first, -1
    smaller ones (--schedule-low-priority-values-first), requests without one last; the policy
    orders requests of equal priority. Every input is the same on every rank (the priority came
    with the broadcast request), so every rank orders alike."""
    if policy not in ("fcfs", "lpm"):
        raise ValueError(f"unknown --schedule-policy {policy!r}")
    ordered = list(waiting)
    if policy == "lpm" and len(ordered) > 1:
        ordered.sort(key=lambda r: -prefix_len_of(r))
    if priority_first and len(ordered) > 1:
        ordered.sort(key=lambda r: (r.priority is None, -priority_first * (r.priority or 0)))
    return ordered


@dataclass
class PrefillBudget:
    """Token budgets for one prefill step."""

    max_prefill_tokens: int  # all new tokens in the step
    chunked_prefill_size: int  # new tokens of one request in one step
    free_tokens: int  # KV tokens free now, plus what the prefix cache could evict
    reserved_tokens: int  # KV held back for running requests' future decode tokens

    def chunk_for(self, extend_len: int, used: int) -> int:
        return max(0, min(extend_len, self.chunked_prefill_size, self.max_prefill_tokens - used))

    page_size: int = 1

    def fits(self, tokens: int, decode_reserve: int, used: int) -> bool:
        # + page_size: a request's last page may be partly empty, and pages are what is allocated.
        return used + tokens + self.page_size + decode_reserve + self.reserved_tokens <= self.free_tokens


def decode_reserve(req: Req, ratio: float) -> int:
    return int(min(req.remaining_new_tokens, RESERVE_CAP_PER_REQ) * ratio)
