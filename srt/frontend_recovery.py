"""The front end's half of an engine restart (recovery.py has the whole story): while the engine
is down new requests wait, and once it is up again every request in flight is replayed.

The TokenizerManager owns one FrontendRecovery and reads it: `reason` makes /health a 503,
`overflow()` refuses a request beyond the held-back cap, `until_recovered()` holds a new request
back before its send. EngineRestarter drives it from the Supervisor's thread, on the manager's
event loop: `begin(reason)` when the engine goes down, `resume()` when the new one is up (between
the two the manager replaces its sockets, TokenizerManager.reset_channels).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

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

    def begin(self, reason: str) -> None:
        """The engine is going down to restart: /health 503, new requests wait, control calls fail."""
        self.reason = reason
        self._recovered.clear()
        self._control_calls.fail_all(f"recovering: {reason}")

    def resume(self) -> int:
        """The new engine is up: replay every request in flight (with the output its client already
        has, ReqState.replay), let the held-back ones through. Returns how many were replayed."""
        replays = [
            state
            for state in self._in_flight.values()
            if state.sent is not None and state.finish_reason is None
        ]
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
