"""The front end's half of an engine restart (srt/frontend_recovery.py), without a server: new
requests wait while the engine is down (up to the cap, then a refusal), a failure ends the wait
with a 503, and resume replays exactly the requests that were sent and have not finished."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from srt.frontend_recovery import FrontendRecovery
from srt.io_struct import FinishReason
from srt.request_state import ReqState, ServiceUnavailableError


@dataclasses.dataclass
class Sent:  # stands in for TokenizedGenerateReq: ReqState.replay only replaces `resume`
    rid: str
    resume: Any = None


class Recorder:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.control_failures: list[str] = []
        self.failure: str | None = None

    def fail_all(self, message: str) -> None:  # ControlCalls.fail_all
        self.control_failures.append(message)


def make(max_held_back: int = 2) -> tuple[FrontendRecovery, dict[str, ReqState], Recorder]:
    in_flight: dict[str, ReqState] = {}
    rec = Recorder()
    recovery = FrontendRecovery(max_held_back, in_flight, rec.sent.append, lambda: rec.failure, rec)  # type: ignore[arg-type]
    return recovery, in_flight, rec


def state(rid: str, sent: bool, output_ids: list[int], finished: bool = False) -> ReqState:
    s = ReqState(rid, 3, asyncio.Event(), None)
    s.sent = Sent(rid) if sent else None  # type: ignore[assignment]
    s.output_ids = output_ids
    s.text = "x" * len(output_ids)
    s.finish_reason = FinishReason("length") if finished else None
    return s


def test_held_back_until_resume_then_replays_the_unfinished_sent_requests() -> None:
    async def scenario() -> None:
        recovery, in_flight, rec = make(max_held_back=2)
        for s in (
            state("a", True, [5, 6]),
            state("b", True, []),
            state("c", False, []),
            state("d", True, [1], True),
        ):
            in_flight[s.rid] = s
        assert recovery.overflow() is None
        recovery.begin("rank 1 exited")
        assert rec.control_failures == ["recovering: rank 1 exited"]
        waiters = [asyncio.create_task(recovery.until_recovered()) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters) and recovery.held_back == 2
        assert recovery.overflow() == "recovering: rank 1 exited; 2 requests are waiting already"
        assert recovery.resume() == 2
        await asyncio.wait_for(asyncio.gather(*waiters), 1)
        assert recovery.reason is None and recovery.held_back == 0 and recovery.overflow() is None
        replayed = {req.rid: req.resume for req in rec.sent}
        assert set(replayed) == {"a", "b"}  # c was never sent, d has finished
        assert replayed["b"] is None and replayed["a"].output_ids == [5, 6]
        assert in_flight["a"].replays == 1 and in_flight["d"].replays == 0

    asyncio.run(scenario())


def test_a_failure_ends_the_wait_with_a_503() -> None:
    async def scenario() -> None:
        recovery, _, rec = make()
        recovery.begin("rank 0 exited")
        waiter = asyncio.create_task(recovery.until_recovered())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        rec.failure = "no restart left"
        recovery.wake()
        with pytest.raises(ServiceUnavailableError, match="no restart left"):
            await asyncio.wait_for(waiter, 1)
        assert recovery.held_back == 0

    asyncio.run(scenario())


def test_serving_lets_requests_through_at_once() -> None:
    async def scenario() -> None:
        recovery, _, _ = make()
        await asyncio.wait_for(recovery.until_recovered(), 1)
        assert recovery.held_back == 0

    asyncio.run(scenario())
