"""The front end's half of an engine restart (recovery.py has the whole story): while the engine
is down new requests wait, and once it is up again every request in flight is replayed.

The TokenizerManager owns one FrontendRecovery and reads it: `reason` makes /health a 503,
`overflow()` refuses a request beyond the held-back cap, `until_recovered()` holds a new request
back before its send. EngineRestarter drives it from the Supervisor's thread, on the manager's
event loop: `begin(reason)` when the engine goes down, `resume()` when the new one is up (between
the two the manager replaces its sockets, TokenizerManager.reset_channels).

The LoRA registry's changes since start-up (adapters loaded and unloaded at runtime) are part of
what it replays: the new engine starts from the flags, so `resume` sends those changes again, in
their order, before any replayed request, and a replayed request finds its adapter. So are the
weights: after /update_weights_from_disk the new engine loads the updated folder (and version)
before any replayed request, never --model-path's; and a pause the ranks held (`in_place`,
`retract`) holds the new engine's steps too, the replayed requests waiting for /continue_generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from srt.io_struct import (
    LoadLoraAdapterReq,
    PauseGenerationReq,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightVersionReq,
)
from srt.request_state import ControlCalls, ReqState, ServiceUnavailableError


class FrontendRecovery:
    """Holds new requests back while the engine restarts (at most `max_held_back` of them; beyond
    that a 503) and replays the requests in flight when it is up again.

    What it touches is the manager's, given here: `in_flight` (the requests by rid, read at
    resume), `send` (a send that never awaits), `failure` (why every request fails now, if it
    does: held-back requests then end with it) and `control_calls` (failed when a restart begins).
    """

    def __init__(
        self,
        max_held_back: int,
        in_flight: Mapping[str, ReqState],
        send: Callable[[Any], None],
        failure: Callable[[], str | None],
        control_calls: ControlCalls,
    ) -> None:
        self.max_held_back = max_held_back
        self._in_flight = in_flight
        self._send = send
        self._failure = failure
        self._control_calls = control_calls
        self.reason: str | None = None  # why the engine is restarting; None while it serves
        self.held_back = 0  # requests waiting for the restart to end
        self._recovered = asyncio.Event()  # set while not recovering (binds to a loop on first wait)
        self._recovered.set()
        # the LoRA registry's changes the engine applied since start-up, in order: (name, folder)
        # a load, (name, None) an unload (record_lora)
        self.lora_changes: list[tuple[str, str | None]] = []
        # the weights' folder since the last update from disk (None: --model-path's) and version
        self.weights: tuple[str | None, str] | None = None
        self.paused = False  # the ranks hold their steps (/pause_generation in_place or retract)

    def record_weights(self, model_path: str | None, version: str) -> None:
        """The weights the engine serves after a change (`model_path` None: the version renamed only)."""
        folder = model_path if model_path is not None else (self.weights or (None, ""))[0]
        self.weights = (folder, version)

    def record_lora(self, name: str, path: str | None) -> None:
        """A change of the LoRA registry the engine applied (`path` None: an unload), to replay after
        a restart. An adapter loaded at runtime and unloaded again leaves no change behind."""
        last = next(
            (i for i in reversed(range(len(self.lora_changes))) if self.lora_changes[i][0] == name), None
        )
        if path is None and last is not None and self.lora_changes[last][1] is not None:
            del self.lora_changes[last]
        else:
            self.lora_changes.append((name, path))

    def begin(self, reason: str) -> None:
        """The engine is going down to restart: /health 503, new requests wait, control calls fail."""
        self.reason = reason
        self._recovered.clear()
        self._control_calls.fail_all(f"recovering: {reason}")

    def resume(self) -> int:
        """The new engine is up: replay the LoRA registry's changes, then every request in flight
        (with the output its client already has, ReqState.replay), let the held-back ones through. Returns how many were replayed."""
        replays = [
            state
            for state in self._in_flight.values()
            if state.sent is not None and state.finish_reason is None
        ]
        if self.weights is not None:  # nobody waits for its reply
            folder, version = self.weights
            self._send(
                UpdateWeightVersionReq("weights-replay", version)
                if folder is None
                else UpdateWeightsFromDiskReq("weights-replay", folder, version)
            )
        if self.paused:  # before the replays: they wait in the queue, their tokens kept
            self._send(PauseGenerationReq("pause-replay", "in_place"))
        for i, (name, path) in enumerate(self.lora_changes):  # nobody waits for their replies
            self._send(
                UnloadLoraAdapterReq(f"lora-replay-{i}", name)
                if path is None
                else LoadLoraAdapterReq(f"lora-replay-{i}", name, path)
            )
        for state in replays:
            state.replays += 1
            self._send(state.replay())
        self.reason = None
        self._recovered.set()
        return len(replays)

    def overflow(self) -> str | None:
        """Why a new request is refused now (503, Retry-After): as many wait as may; None otherwise."""
        if self.reason is not None and self.held_back >= self.max_held_back:
            return f"recovering: {self.reason}; {self.held_back} requests are waiting already"
        return None

    async def until_recovered(self, requests: int = 1) -> None:
        """Hold new requests (a call's `requests`) back while the engine restarts;
        ServiceUnavailableError after a failure."""
        while self.reason is not None and self._failure() is None:
            self.held_back += requests
            try:
                await self._recovered.wait()
            finally:
                self.held_back -= requests
        failure = self._failure()
        if failure is not None:
            raise ServiceUnavailableError(failure)

    def wake(self) -> None:
        """Let the held-back requests look again: after a failure they end with it."""
        self._recovered.set()
