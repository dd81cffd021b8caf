"""The scheduling cycle: the async shell around the pure planner.

1. pending jobs  2. fleet snapshot (summaries less in-flight offers)  3. plan_cycle
4. commit Dispatched (compare-and-swap) and send offers  5. record reasons for the rest.
Runs whenever something changed (a submit, a summary, a rejection, a finished job), at most
once per `min_interval`, and at least every `max_interval` for time-based conditions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from broker.dispatch import fleet as fleet_
from broker.dispatch import lifecycle as lifecycle_
from broker.scheduler import planning
from broker.telemetry import metrics

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        lifecycle: lifecycle_.Lifecycle,
        fleet: fleet_.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        min_interval: float = 0.005,
        max_interval: float = 1.0,
    ) -> None:
        self.lifecycle = lifecycle
        self.fleet = fleet
        self.meters = meters
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.cycles = 0

    async def run_cycle(self) -> int:
        """One cycle; returns the number of offers sent."""
        started = time.perf_counter()
        pending = self.lifecycle.pending()
        offers = 0
        if pending:
            fleet = self.fleet.snapshot(now=time.monotonic())
            plan_started = time.perf_counter()
            plan = planning.plan_cycle(fleet, pending)
            decided = time.perf_counter() - plan_started
            self.meters.decision_duration.observe(decided / len(pending))
            offers = await self.lifecycle.dispatch(plan)
        self._export_gauges()
        self.cycles += 1
        self.meters.cycle_duration.observe(time.perf_counter() - started)
        return offers

    def _export_gauges(self) -> None:
        by_queue: Counter[str] = Counter()
        for job_id in self.lifecycle.queued:
            record = self.lifecycle.jobs.get(job_id)
            if record is not None:
                by_queue[record.job.spec.queue] += 1
        self.meters.pending_jobs.clear()
        for queue, count in by_queue.items():
            self.meters.pending_jobs.labels(queue=queue).set(count)

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
            try:
                await self.run_cycle()
            except Exception:
                logger.exception("scheduling cycle failed")
            await asyncio.sleep(self.min_interval)


async def stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
