"""The scheduling cycle: the async shell around the pure planner.

1. pending jobs, jobs holding GPUs, victims still releasing theirs  2. fleet snapshot
(summaries less in-flight offers)  3. plan_cycle with the queues configuration
4. preempt the victims chosen (Cancel, reason Preempted)  5. commit Dispatched
(compare-and-swap) and send offers  6. record reasons for the rest; keep the reservations
for the next cycle; export the per-queue gauges.
Runs whenever something changed (a submit, a summary, a rejection, a finished job), at most
once per `min_interval`, and at least every `max_interval` for time-based conditions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import overload

from broker.api import status
from broker.dispatch import fleet as fleet_
from broker.dispatch import lifecycle as lifecycle_
from broker.scheduler import planning, registry, reservation, snapshot, usage
from broker.telemetry import metrics

logger = logging.getLogger(__name__)


class LazyRunning(Sequence[snapshot.RunningJob]):
    """The jobs holding GPUs, read from the lifecycle only if the planner looks at them (a
    preemption search): a cycle that preempts nothing does not walk every running job."""

    def __init__(self, load: Callable[[], list[snapshot.RunningJob]]) -> None:
        self._load = load
        self._jobs: list[snapshot.RunningJob] | None = None

    def _all(self) -> list[snapshot.RunningJob]:
        if self._jobs is None:
            self._jobs = self._load()
        return self._jobs

    @overload
    def __getitem__(self, index: int) -> snapshot.RunningJob: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[snapshot.RunningJob]: ...

    def __getitem__(
        self, index: int | slice
    ) -> snapshot.RunningJob | Sequence[snapshot.RunningJob]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[snapshot.RunningJob]:
        return iter(self._all())


class Scheduler:
    def __init__(
        self,
        lifecycle: lifecycle_.Lifecycle,
        fleet: fleet_.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        min_interval: float = 0.005,
        max_interval: float = 1.0,
        queues: registry.QueueRegistry | None = None,
        queue_gauges_every: float = 0.5,
    ) -> None:
        self.lifecycle = lifecycle
        self.fleet = fleet
        self.meters = meters
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.cycles = 0
        self.queues = queues or registry.QueueRegistry()
        self.reservations: dict[str, reservation.Reservation] = {}
        self.queue_gauges_every = queue_gauges_every
        self._queue_gauges_at = 0.0
        self.resync_every = 5.0
        self.last_plan_seconds = 0.0
        self._resynced_at = time.monotonic()

    async def run_cycle(self) -> int:
        """One cycle; returns the number of offers sent."""
        started = time.perf_counter()
        pending = self.lifecycle.pending()
        offers = 0
        if time.monotonic() - self._resynced_at > self.resync_every:
            self.lifecycle.resync_usage()
            self._resynced_at = time.monotonic()
        if pending:
            running = LazyRunning(self.lifecycle.running_jobs)
            releasing = self.lifecycle.releasing()
            fleet = self.fleet.snapshot(now=time.monotonic())
            plan_started = time.perf_counter()
            plan = planning.plan_cycle(
                fleet,
                pending,
                running=running,
                usage=self.lifecycle.usage(),
                queues=self.queues.config,
                reservations=self.reservations,
                releasing=releasing,
                now=status.utcnow(),
            )
            decided = time.perf_counter() - plan_started
            self.last_plan_seconds = decided
            self.meters.decision_duration.observe(decided / len(pending))
            self.reservations = plan.reservations
            await self.lifecycle.preempt(plan.preemptions)
            offers = await self.lifecycle.dispatch(plan)
        else:
            self.reservations = {}
        self._export_gauges()
        self._export_queue_gauges()
        self.cycles += 1
        self.meters.scheduling_cycles.inc()
        self.meters.cycle_duration.observe(time.perf_counter() - started)
        return offers

    def _export_gauges(self) -> None:
        by_queue: Counter[str] = Counter()
        oldest: dict[str, datetime] = {}
        for job_id in self.lifecycle.queued:
            record = self.lifecycle.jobs.get(job_id)
            if record is not None:
                queue = record.job.spec.queue
                by_queue[queue] += 1
                since = record.status.events[-1].time if record.status.events else record.created
                oldest[queue] = min(oldest.get(queue, since), since)
        now = status.utcnow()
        self.meters.pending_jobs.clear()
        self.meters.pending_oldest_age.clear()
        for queue, count in by_queue.items():
            self.meters.pending_jobs.labels(queue=queue).set(count)
            age = (now - oldest[queue]).total_seconds()
            self.meters.pending_oldest_age.labels(queue=queue).set(max(0.0, age))

    def _export_queue_gauges(self) -> None:
        """GPUs in use, guaranteed and fair share per queue and model (at most every
        `queue_gauges_every` seconds: they cost a pass over the jobs holding GPUs)."""
        now = time.monotonic()
        if now - self._queue_gauges_at < self.queue_gauges_every:
            return
        self._queue_gauges_at = now
        views = usage.build_views(
            self.queues.config,
            running=self.lifecycle.running_jobs(),
            pending=self.lifecycle.pending(),
            fleet_gpus=self.fleet.snapshot(now=now).total_gpus(),
        )
        for gauge in (
            self.meters.queue_gpus_in_use,
            self.meters.queue_gpus_guaranteed,
            self.meters.queue_gpus_fair_share,
            self.meters.queue_dominant_share,
        ):
            gauge.clear()
        for view in views:
            self.meters.queue_dominant_share.labels(queue=view.name).set(view.status.dominant_share)
            for item in view.status.gpus:
                labels = {"queue": view.name, "model": item.model}
                self.meters.queue_gpus_in_use.labels(**labels).set(item.in_use)
                self.meters.queue_gpus_guaranteed.labels(**labels).set(item.guaranteed)
                self.meters.queue_gpus_fair_share.labels(**labels).set(item.fair_share)
        self.meters.reservations.set(len(self.reservations))

    async def run(self) -> None:
        wakeups = (self.lifecycle.wakeup, self.fleet.changed)
        while True:
            waiters = [asyncio.ensure_future(e.wait()) for e in wakeups]
            try:
                await asyncio.wait(
                    waiters, timeout=self.max_interval, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
            for event in wakeups:
                event.clear()
            self.last_plan_seconds = 0.0
            try:
                await self.run_cycle()
            except Exception:
                logger.exception("scheduling cycle failed")
            # long planning (a deep backlog) is followed by a pause as long (at most 0.1 s):
            # planning never takes more than half of the broker's time
            pause = min(self.last_plan_seconds, 0.1)
            await asyncio.sleep(max(self.min_interval, pause))


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
