"""The garbage collector's pauses: measured, and kept to what changed lately.

CPython's collector stops the world for a full pass over every container object in its
oldest generation, and a broker holds tens of objects per job in its book (models, their
dicts, lists of events and pods). A full pass over a large book holds the event loop long
enough for a leader to miss its lease renewals (`broker.state.renewing`) and for the
watchdog to take healthy agents for silent ones, and one comes each time a quarter again as
many objects have survived into that generation: with jobs going through quickly, often.

`settle` is for a process's start: what it has loaded by then (the book, the inventory)
lives as long as it does, so it is collected once and frozen out of every later pass, and
the youngest generation's threshold raised (below). The broker and the agent both call it.

`Collector` (the broker's) does three things more:

- while installed, it raises the youngest generation's threshold (`THRESHOLDS`): CPython's
  default, a young pass every 700 allocations net of frees, costs a busy process a pass
  every few hundred microseconds over objects most of which reference counting frees a
  moment later (a request's parsed body, a record being encoded), and moves them on to the
  older generations, whose passes then look at them again;
- it measures every pass (`gc.callbacks`) in `gpufed_gc_pause_seconds{generation}` and logs
  a pass longer than `warn_seconds`;
- every `freeze_every` seconds it moves everything the generations hold into the permanent
  generation (`gc.freeze`), with no pass first: automatic full passes then look only at
  what survived since. No pass, not even of the youngest generation: a young pass walks
  every object allocated since the last one, and while jobs retire as fast as new ones come
  the youngest generation's count (allocations less deallocations of any age) stays near
  zero, so that walk would cover everything since the last freeze. What dies in a cycle
  before a freeze is frozen with the rest; frozen objects are still freed by reference
  counting when dropped (records, models: no cycles). Only a cycle that dies while frozen,
  or is frozen dead, waits for the reclaiming pass: every `full_every` seconds everything is
  unfrozen, fully collected once and frozen again. On the leader that pass waits for the
  moment just after a lease renewal (`just_renewed`), when the lease has the most time
  left, and runs only if it fits (`budget`: the lease's slack, and two heartbeats, within
  which the agents hear nothing: they reconnect after three). The pass holds the
  interpreter lock throughout, so the lease keeper cannot renew during it. Its length is
  foreseen from the process's resident memory and the seconds per MiB the last pass took
  (`SECONDS_PER_MIB` before the first); not from the frozen objects' count, as
  `gc.get_freeze_count()` walks the whole permanent generation. A pass that does not fit
  waits; memory falls as the jobs leave the book, and the pass runs.

Memory given back. Every `trim_every` seconds, and as soon as the book holds
`trim_after_jobs` fewer jobs than at its highest since the last trim (`held`: jobs retired
to history, their records freed), the C allocator is asked to return its free pages to the
system (glibc's `malloc_trim`); on a timer alone, a trim could come just before a wave of
jobs retired, and the memory stay taken until the next one. That does something only when
the process runs with `PYTHONMALLOC=malloc` (the chart and `gpufed local` set it): Python's
own allocator frees a 1 MiB arena only when every object in it is gone, so a process that
once held many jobs keeps its peak. `gpufed local` preloads jemalloc where the system has
it (`gpufed.local.allocator`), which returns dirty pages on its own timer; the trim then
finds glibc's heap empty and costs nothing.

`broker.app` starts the collector when `freeze_gc` is set (the service's default; tests of
the app leave the collector alone).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import resource
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram

logger = logging.getLogger(__name__)


def _libc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library, another system)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_malloc_trim = _libc_trim()

FREEZE_EVERY_SECONDS = 2.0
FULL_EVERY_SECONDS = 600.0
TRIM_EVERY_SECONDS = 60.0
TRIM_AFTER_JOBS = 1000
WARN_SECONDS = 0.25
# a young pass every 20,000 allocations net of frees (CPython's default: 700); the older
# generations' thresholds as CPython's, counted in passes of the generation below
THRESHOLDS = (20_000, 10, 10)
LATEST_RENEWAL_SECONDS = 0.5  # a full pass on the leader only this soon after a renewal
DUE_CHECK_SECONDS = 0.05
SECONDS_PER_MIB = 0.004  # a full pass's cost per MiB resident, foreseen before one is measured
MIB = 1024 * 1024
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MEASURED_FROM_MIB = 64.0  # a pass over less memory than this measures no rate
PASS_HEADROOM = 1.5  # a full pass runs if 1.5 times its foreseen length...
PASS_MARGIN_SECONDS = 0.5  # ...and half a second more fit in the budget


def settle(*, young: int | None = None) -> None:
    """Collect once and freeze what survives: what a process has loaded by now lives as long
    as it does, and later passes need not look at it. `young`: the youngest generation's
    threshold from now on (the older ones' left as they are; None: left alone)."""
    gc.collect()
    gc.freeze()
    if young is not None:
        gc.set_threshold(young, *gc.get_threshold()[1:])


def resident_mib() -> float:
    """The process's resident memory in MiB (Linux: /proc; elsewhere its peak, from rusage)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        return pages * PAGE_SIZE / MIB
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Collector:
    def __init__(
        self,
        pauses: Histogram,
        *,
        freeze_every: float = FREEZE_EVERY_SECONDS,
        full_every: float = FULL_EVERY_SECONDS,
        trim_every: float = TRIM_EVERY_SECONDS,
        trim_after_jobs: int = TRIM_AFTER_JOBS,
        warn_seconds: float = WARN_SECONDS,
        thresholds: tuple[int, int, int] | None = THRESHOLDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pauses = pauses
        self.freeze_every = freeze_every
        self.full_every = full_every
        self.trim_every = trim_every
        self.trim_after_jobs = trim_after_jobs
        self.trims = 0
        self._most_held = 0  # the book's jobs at their highest since the last trim
        self.warn_seconds = warn_seconds
        self.thresholds = thresholds  # None: CPython's, left as they are
        self._thresholds_before: tuple[int, int, int] | None = None
        self.clock = clock
        self.freezes = 0
        self.full_passes = 0
        self.postponed = 0  # full passes put off: they would not fit in the budget
        self.seconds_per_mib = SECONDS_PER_MIB
        self._started: float | None = None

    def install(self) -> None:
        """Measure every pass from now on, with `thresholds` (once; `uninstall` undoes it)."""
        if self._measure not in gc.callbacks:
            gc.callbacks.append(self._measure)
            if self.thresholds is not None:
                self._thresholds_before = gc.get_threshold()
                gc.set_threshold(*self.thresholds)

    def uninstall(self) -> None:
        if self._measure in gc.callbacks:
            gc.callbacks.remove(self._measure)
        if self._thresholds_before is not None:
            gc.set_threshold(*self._thresholds_before)
            self._thresholds_before = None

    def _measure(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        took = time.perf_counter() - self._started
        self._started = None
        generation = int(info.get("generation", 2))
        self.pauses.labels(generation=str(generation)).observe(took)
        if took > self.warn_seconds:
            logger.warning(
                "the garbage collector held the loop %.2f s (generation %d, %d objects collected)",
                took,
                generation,
                int(info.get("collected", 0)),
            )

    def freeze(self) -> None:
        """Keep every object the collector tracks now out of later passes, without a pass
        of its own (a cycle dead by then waits for the full pass: see the module's
        docstring). O(1): `gc.freeze` moves the generations' lists whole."""
        gc.freeze()
        self.freezes += 1

    def trim(self) -> None:
        """Free pages of the C allocator back to the system (glibc only; else nothing)."""
        if _malloc_trim is None:
            return
        started = time.perf_counter()
        _malloc_trim(0)
        self.trims += 1
        logger.debug("malloc_trim took %.3f s", time.perf_counter() - started)

    def shrunk(self, held: int) -> bool:
        """Whether the book, now `held` jobs, holds `trim_after_jobs` fewer than at its
        highest since the last trim (which this answer, when yes, starts again from)."""
        self._most_held = max(self._most_held, held)
        if self._most_held - held < self.trim_after_jobs:
            return False
        self._most_held = held
        return True

    def foreseen(self) -> float:
        """How long a full pass would take now, from the memory it would look through and
        what the latest pass took per MiB (O(1): no count of the objects)."""
        return self.seconds_per_mib * resident_mib()

    def fits(self, budget: float) -> bool:
        """Whether a full pass now is foreseen to end well within `budget` seconds."""
        return self.foreseen() * PASS_HEADROOM + PASS_MARGIN_SECONDS <= budget

    def full_pass(self) -> None:
        """Everything collected once (cycles that died frozen too), then frozen again."""
        resident = resident_mib()
        started = time.perf_counter()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        took = time.perf_counter() - started
        if resident >= MEASURED_FROM_MIB:
            self.seconds_per_mib = took / resident
        self.full_passes += 1

    async def run(
        self,
        just_renewed: Callable[[float], bool] | None = None,
        budget: Callable[[], float] | None = None,
        held: Callable[[], int] | None = None,
    ) -> None:
        """Freeze every `freeze_every` s and reclaim every `full_every` s, until cancelled;
        trim every `trim_every` s and when the book (`held()` jobs) has shrunk;
        `just_renewed(seconds)` (the leader's lease renewed that recently, or no lease held)
        says when a full pass may start, and `budget()` how long it may take then (seconds:
        the leader's lease slack and its agents' patience; infinite on a follower). Never
        ends on an error."""
        full_due = self.clock() + self.full_every
        trim_due = self.clock() + self.trim_every
        while True:
            await asyncio.sleep(self.freeze_every)
            try:
                shrunk = held is not None and self.shrunk(held())
                if shrunk or self.clock() >= trim_due:
                    self.trim()
                    trim_due = self.clock() + self.trim_every
                if self.clock() < full_due:
                    self.freeze()
                    continue
                # a moment in time, not an event: looked at every few tens of milliseconds
                while just_renewed is not None and not just_renewed(LATEST_RENEWAL_SECONDS):  # noqa: ASYNC110
                    await asyncio.sleep(DUE_CHECK_SECONDS)
                if budget is not None and not self._may_pass(budget()):
                    self.freeze()
                    continue
                self.full_pass()
                full_due = self.clock() + self.full_every
            except Exception:  # the collector's trouble must not end the broker's task
                logger.exception("collector housekeeping failed")

    def _may_pass(self, budget: float) -> bool:
        """Whether the full pass due fits in `budget`; if not, it is counted as put off (and
        told once in a row of them)."""
        if self.fits(budget):
            if self.postponed:
                logger.info("the full collection put off %d times runs now", self.postponed)
            self.postponed = 0
            return True
        if not self.postponed:
            logger.warning(
                "the full collection is put off: over %.0f MiB, about %.1f s, it would not "
                "fit in the %.1f s the lease and the agents allow (it runs once it fits)",
                resident_mib(),
                self.foreseen(),
                budget,
            )
        self.postponed += 1
        return False
