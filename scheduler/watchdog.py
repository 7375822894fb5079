"""Soft and hard watchdogs on a rank's forward progress.

Armed only while the rank has work pending, so an idle server never fires. When the forward-step
counter has not moved for `timeout_s`: log this rank's stacks (py-spy, or Python's faulthandler
when py-spy is missing) and the scheduler's state. Soft keeps serving and re-arms after progress;
hard then exits the process non-zero, and the launcher's supervisor takes the server down.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("srt.watchdog")

WATCHDOG_EXIT_CODE = 75
PY_SPY_ENV = "SRT_PY_SPY"  # path or name of the py-spy binary; tests point it nowhere


def dump_stacks(pid: int | None = None) -> str:
    """Stacks of every thread of `pid` (default: this process)."""
    pid = pid or os.getpid()
    binary = shutil.which(os.environ.get(PY_SPY_ENV, "py-spy"))
    if binary is not None:
        try:
            done = subprocess.run(
                [binary, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
            )
            if done.returncode == 0 and done.stdout.strip():
                return "py-spy dump:\n" + done.stdout
            logger.warning("py-spy failed (%s); falling back to faulthandler", done.stderr.strip()[:200])
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning("py-spy failed (%s); falling back to faulthandler", e)
    if pid != os.getpid():
        return f"(no py-spy: cannot dump pid {pid} from here)"
    with tempfile.TemporaryFile("w+") as f:  # faulthandler needs a real file descriptor
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return "faulthandler dump (py-spy not available):\n" + f.read()


class Watchdog:
    def __init__(
        self,
        *,
        name: str,
        timeout_s: float,
        soft: bool,
        progress: Callable[[], int],
        busy: Callable[[], bool],
        describe: Callable[[], str],
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.soft = soft
        self._progress = progress
        self._busy = busy
        self._describe = describe
        self._exit = exit_fn
        self.fired = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{'soft' if soft else 'hard'}-watchdog", daemon=True
        )

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        last_seen = self._progress()
        last_change = time.monotonic()
        armed = True
        while not self._stop.wait(poll):
            now = time.monotonic()
            seen = self._progress()
            if seen != last_seen or not self._busy():
                last_seen, last_change, armed = seen, now, True
                continue
            if armed and now - last_change >= self.timeout_s:
                armed = False  # soft: once per stall; hard: we exit below
                self._fire(now - last_change)

    def _fire(self, stalled_s: float) -> None:
        self.fired += 1
        kind = "soft watchdog" if self.soft else "watchdog"
        report = io.StringIO()
        report.write(
            f"{self.name} {kind} timeout: no forward progress for {stalled_s:.1f} s "
            f"(--{'soft-' if self.soft else ''}watchdog-timeout {self.timeout_s:g}) while work is pending\n"
        )
        try:
            report.write(f"scheduler state: {self._describe()}\n")
        except Exception as e:  # the state is best effort; the stacks matter more
            report.write(f"scheduler state unavailable: {e!r}\n")
        report.write(dump_stacks())
        logger.error("%s", report.getvalue())
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if not self.soft:
            logger.critical("%s: hard watchdog fired; exiting with code %d", self.name, WATCHDOG_EXIT_CODE)
            logging.shutdown()
            self._exit(WATCHDOG_EXIT_CODE)
