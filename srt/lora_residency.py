"""Which LoRA adapters leave when more are loaded than `--max-loaded-loras` allows (SGLang's rule).

After a load, while more adapters are loaded than the bound, the front end unloads the one that
`--lora-eviction-policy` names first among those not pinned: `lru`, the one whose last request is
the oldest (a load counts as a use), or `fifo`, the one loaded first. The unload is an ordinary
/unload_lora_adapter: a control message of rank 0's broadcast, so every rank's registry changes
alike, that refuses the name to new requests at once and answers once the requests running or
queued under it have finished. Adapters so never accumulate until memory runs out (issue 61's
"adapters accumulating until a hang under RL rotation").
"""

from __future__ import annotations

from collections.abc import Iterable

EVICTION_POLICIES = ("lru", "fifo")


class LoraResidency:
    def __init__(self, bound: int | None, policy: str, names: Iterable[str]) -> None:
        """`bound`: --max-loaded-loras (None: no bound); `names`: the adapters loaded at start-up, in
        --lora-paths order."""
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"--lora-eviction-policy takes {' or '.join(EVICTION_POLICIES)}, got {policy!r}")
        self.bound = bound
        self.policy = policy
        self.order: dict[str, None] = dict.fromkeys(names)  # first to leave first
        self.pinned: set[str] = set()

    def used(self, names: Iterable[str]) -> None:
        """Requests named these adapters (lru moves each to the back)."""
        if self.policy == "lru":
            for name in names:
                if name in self.order:
                    self.order[name] = self.order.pop(name)

    def loaded(self, name: str, pinned: bool) -> None:
        self.order[name] = None
        if pinned:
            self.pinned.add(name)

    def unloaded(self, name: str) -> None:
        self.order.pop(name, None)
        self.pinned.discard(name)

    def over_bound(self) -> list[str]:
        """The adapters to unload, in order, for the rest to fit the bound (pinned ones never; so
        fewer where too many are pinned)."""
        excess = 0 if self.bound is None else len(self.order) - self.bound
        return [name for name in self.order if name not in self.pinned][: max(excess, 0)]
