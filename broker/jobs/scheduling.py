"""The scheduling cycle: the async shell around the pure planner.

1. pending jobs, jobs holding GPUs, victims still releasing theirs  2. fleet snapshot
(summaries less in-flight offers)  3. plan_cycle with the queues configuration
4. preempt the victims chosen (Cancel, reason Preempted)  5. commit Dispatched
(compare-and-swap) and send offers (`dispatching`)  6. record reasons for the rest; keep
the reservations for the next cycle; export the per-queue gauges.
A dispatch the store refuses leaves the jobs queued; the next cycles back off (up to 2 s)
until a commit goes through.
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
from broker.jobs import accounting, book, dispatching, fleet, preempting
from broker.planning import planning, reservation, snapshot, usage
from broker.state import registry
from broker.telemetry import metrics

logger = logging.getLogger(__name__)


class LazyRunning(Sequence[snapshot.RunningJob]):
    """The jobs holding GPUs, read from the book only if the planner looks at them (a
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
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        dispatcher: dispatching.Dispatcher,
        accounts: accounting.Accounting,
        victims: preempting.Preemptions,
        meters: metrics.BrokerMetrics,
        min_interval: float = 0.005,
        max_interval: float = 1.0,
        queues: registry.QueueRegistry | None = None,
        queue_gauges_every: float = 0.5,
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.dispatcher = dispatcher
        self.accounts = accounts
        self.victims = victims
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
        self.commit_failures = 0  # dispatch commits failed in a row: the next cycle waits

    async def run_cycle(self) -> int:
        """One cycle; returns the number of offers sent."""
        started = time.perf_counter()
        pending = self.dispatcher.pending()
        offers = 0
        if time.monotonic() - self._resynced_at > self.resync_every:
            self.accounts.resync()
            self._resynced_at = time.monotonic()
        if pending:
            running = LazyRunning(self.accounts.running_jobs)
            releasing = self.victims.releasing()
            fleet = self.fleet.snapshot(now=time.monotonic())
            plan_started = time.perf_counter()
            plan = planning.plan_cycle(
                fleet,
                pending,
                running=running,
                usage=self.accounts.usage(),
                queues=self.queues.config,
                reservations=self.reservations,
                releasing=releasing,
                now=status.utcnow(),
            )
            decided = time.perf_counter() - plan_started
            self.last_plan_seconds = decided
            self.meters.decision_duration.observe(decided / len(pending))
            self.reservations = plan.reservations
            self._note_set_aside(plan, fleet)
            await self.victims.preempt(plan.preemptions)
            outcome = await self.dispatcher.dispatch(plan)
            offers = outcome.sent
            self.commit_failures = self.commit_failures + 1 if outcome.failed else 0
            if outcome.failed:
                self.book.wakeup.set()  # plan them again once the pause is over
        else:
            self.reservations = {}
        self._export_gauges()
        self._export_queue_gauges()
        self.cycles += 1
        self.meters.scheduling_cycles.inc()
        self.meters.cycle_duration.observe(time.perf_counter() - started)
        return offers

    def _note_set_aside(self, plan: planning.CyclePlan, planned: snapshot.FleetSnapshot) -> None:
        """Count and log what the cycle set aside; a cluster keeps its reason (shown by
        `GET /v1/clusters`) until a cycle plans it again."""
        aside = {item.name: item.reason for item in plan.set_aside if item.kind == "cluster"}
        for cluster in self.fleet.clusters.values():
            if cluster.name in aside:
                cluster.planning_error = f"set aside by the scheduler: {aside[cluster.name]}"
            elif cluster.name in planned.clusters:
                cluster.planning_error = None
        for item in plan.set_aside:
            self.meters.set_aside.labels(kind=item.kind).inc()
            logger.error("scheduling cycle set aside %s %s: %s", item.kind, item.name, item.reason)

    def _export_gauges(self) -> None:
        by_queue: Counter[str] = Counter()
        oldest: dict[str, datetime] = {}
        for job_id in self.book.queued():
            record = self.book.get(job_id)
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
            running=self.accounts.running_jobs(),
            pending=self.dispatcher.pending(),
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
        wakeups = (self.book.wakeup, self.fleet.changed)
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
                self.commit_failures += 1  # whatever broke, the next cycles wait longer
                self.meters.background_errors.labels(task="scheduler").inc()
                logger.exception("scheduling cycle failed")
            # long planning (a deep backlog) is followed by a pause as long (at most 0.1 s):
            # planning never takes more than half of the broker's time
            pause = min(self.last_plan_seconds, 0.1)
            if self.commit_failures:  # the store refuses dispatches: back off, up to 2 s
                pause = max(pause, min(2.0, 0.05 * 2 ** min(self.commit_failures, 6)))
            await asyncio.sleep(max(self.min_interval, pause))


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
