"""The per-process log of events that every rank must record identically.

Events get consecutive sequence numbers from 0. The checker compares a window of them between
ranks and then drops it, so memory holds only the events not yet compared by every group:

    seq:   0 ........ base ............ count
           [dropped]  [held in memory]  <- record() appends here

`record()` is a no-op until `set_enabled(True)`; the flag is a module global so that a disabled
`@rank_consensus` call costs one attribute load and a branch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from consensus.canonical import canonical, event_digest

REPORT_CHARS = 240  # an event's text in divergence reports is cut to this length

ENABLED = False


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    name: str
    digest: int  # signed int64, over name and the full canonical payload
    text: str  # canonical payload, cut to REPORT_CHARS

    def describe(self) -> str:
        return f"#{self.seq} {self.name} {self.text}"


class EventLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # record() runs on the scheduler thread, trimming on the checker's
        self._events: list[Event] = []
        self._base = 0

    @property
    def count(self) -> int:
        """Events recorded since the last clear(), dropped ones included."""
        return self._base + len(self._events)

    @property
    def held(self) -> int:
        """Events still in memory (recorded, not yet compared by every group)."""
        return len(self._events)

    def append(self, name: str, payload: object) -> Event:
        text = canonical(payload)  # outside the lock: it is the slow part
        digest = event_digest(name, text)
        if len(text) > REPORT_CHARS:
            text = text[:REPORT_CHARS] + "..."
        with self._lock:
            event = Event(self._base + len(self._events), name, digest, text)
            self._events.append(event)
        return event

    def window(self, start: int, stop: int) -> list[Event]:
        """Events with start <= seq < stop; raises if some were already dropped."""
        with self._lock:
            if start < self._base or stop > self.count:
                raise IndexError(f"events [{start}, {stop}) not held (held [{self._base}, {self.count}))")
            return self._events[start - self._base : stop - self._base]

    def drop_before(self, seq: int) -> None:
        with self._lock:
            n = max(0, min(seq, self.count) - self._base)
            del self._events[:n]
            self._base += n

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._base = 0


LOG = EventLog()


def set_enabled(enabled: bool) -> None:
    global ENABLED
    ENABLED = enabled


def record(name: str, payload: object = None) -> None:
    """Appends an event to this process's log when the checker is enabled; free otherwise."""
    if ENABLED:
        LOG.append(name, payload)
