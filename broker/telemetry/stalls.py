"""Event-loop stalls: how late the loop runs, and what held it when it was blocked.

Everything a broker does runs on one asyncio loop: the leader's lease, the agents'
heartbeats, the API. A piece of work that holds the loop for seconds (a scheduling cycle over
a deep backlog, a collector pass over a large heap) makes the leader miss its lease and the
watchdog take healthy agents for silent ones. `LoopMonitor` makes such stalls visible:

- a task on the loop notes the time every `tick` seconds; the lag (how late it woke) is
  observed in `gpufed_event_loop_lag_seconds`;
- a thread beside the loop checks that note; when the loop has not ticked for `stall`
  seconds, it logs one warning with the stack the loop's thread is in at that moment (what
  holds it), and when the loop comes back, how long the stall lasted.

`broker.app` starts it for the service; the thread is a daemon and costs one wake-up a tick.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from prometheus_client import Histogram

logger = logging.getLogger(__name__)

MAX_STACK_FRAMES = 12


class LoopMonitor:
    def __init__(self, lag: Histogram, *, tick: float = 0.1, stall: float = 1.0) -> None:
        self.lag = lag
        self.tick = tick
        self.stall = stall
        self.stalls = 0  # stalls seen (tests, logs)
        self._ticked = time.monotonic()
        self._loop_thread: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def run(self) -> None:
        """Tick until cancelled (and stop the watching thread then)."""
        self._loop_thread = threading.get_ident()
        self._ticked = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="loop-stalls", daemon=True)
        self._thread.start()
        try:
            while True:
                before = time.monotonic()
                await asyncio.sleep(self.tick)
                now = time.monotonic()
                self._ticked = now
                self.lag.observe(max(0.0, now - before - self.tick))
        finally:
            self._stop.set()

    def _watch(self) -> None:
        stalled_since: float | None = None
        while not self._stop.wait(self.tick):
            ticked = self._ticked
            late = time.monotonic() - ticked
            if stalled_since is None and late >= self.stall:
                stalled_since = ticked
                self.stalls += 1
                logger.warning(
                    "the event loop has been blocked for %.1f s; it is in:\n%s",
                    late,
                    self._stack(),
                )
            elif stalled_since is not None and ticked > stalled_since:
                logger.warning("the event loop was blocked for %.1f s", ticked - stalled_since)
                stalled_since = None

    def _stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "  (the loop's thread is gone)"
        lines = traceback.format_stack(frame)[-MAX_STACK_FRAMES:]
        return "".join(lines).rstrip()
