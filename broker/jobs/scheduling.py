"""The scheduling cycle: the async shell around the pure planner, in numbered phases
(`Scheduler.run_cycle`, as Kueue's `schedule`), each line it logs carrying its number
(`cycle`, bound through `kits.logcontext`):

1. pending jobs: the backlog brought up to date with the jobs that changed; the holdings
   counted again now and then
2. snapshot: the fleet (summaries less in-flight offers), the jobs holding GPUs, the victims
   still releasing theirs
3. plan: `parking.plan_backlog` with the queues configuration, plan_cycle over the live jobs
   and the parked ones a change woke
4. assume: park the jobs that could not act; keep the reservations for the next cycle and
   the clusters set aside
5. preempt the victims chosen (Cancel, reason Preempted)
6. commit Dispatched (compare-and-swap) and send the offers (`dispatching`); reasons
   recorded for the rest (a parked job keeps its last ones)
7. export the gauges.

The backlog is kept between cycles (`planning.backlog`): a book observer notes the jobs that
changed, and a cycle with nothing new costs O(clusters + live jobs), not O(queued jobs). A
cycle plans at most `plan_limit` jobs (`planning.backlog.budget`) and reads at most `look_limit`
changed ones into the backlog: a deep backlog is worked through in slices, cycle after cycle,
each slice smaller while planning is slow (`budget.next_limit`: about a quarter of a second).
`full_replan=True` plans every pending job every cycle instead (the same decisions, the old
cost: benchmarks compare them).
A dispatch the store refuses leaves the jobs queued; the next cycles back off (up to 2 s)
until a commit goes through.
Runs whenever something changed (a submit, a summary, a rejection, a finished job), at most
once per `min_interval`, and at least every `max_interval` for time-based conditions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import overload

from broker.api import status
from broker.api.status import JobState
from broker.jobs import accounting, book, dispatching, fleet, positions, preempting
from broker.planning import planning, plans, snapshot, usage
from broker.planning.backlog import backlog, budget, parking
from broker.state import errors, registry
from broker.telemetry import metrics
from kits import logcontext, tables, tasks

logger = logging.getLogger(__name__)
# a job excluded from no cluster: one empty set for all (each `frozenset()` is a new one)
_NONE_EXCLUDED: frozenset[str] = frozenset()


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


class Waits:
    """The queued jobs per queue and since when each waits: the pending gauges, kept as
    jobs change rather than counted over the backlog every cycle."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[str, datetime]] = {}
        self._oldest: dict[str, list[tuple[datetime, str]]] = {}  # heaps, stale entries left
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._jobs)

    def ids(self) -> set[str]:
        return set(self._jobs)

    def put(self, job_id: str, queue: str, since: datetime) -> None:
        if self._jobs.get(job_id) == (queue, since):
            return
        self.drop(job_id)
        self._jobs[job_id] = (queue, since)
        self.counts[queue] += 1
        heapq.heappush(self._oldest.setdefault(queue, []), (since, job_id))

    def drop(self, job_id: str) -> None:
        found = self._jobs.pop(job_id, None)
        if found is not None:
            tables.shrink(self._jobs)
            self.counts[found[0]] -= 1
            if self.counts[found[0]] <= 0:
                del self.counts[found[0]]

    def oldest(self, queue: str) -> datetime | None:
        heap = self._oldest.get(queue, [])
        if len(heap) > 2 * self.counts.get(queue, 0) + 64:  # mostly stale: keep the rest
            heap[:] = list({(t, j) for t, j in heap if self._jobs.get(j) == (queue, t)})
            heapq.heapify(heap)
        while heap and self._jobs.get(heap[0][1]) != (queue, heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None


class Lap:
    """The seconds a block took (`time.perf_counter`): `with Lap() as lap: ...`, then
    `lap.seconds`, also when the block raised."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> Lap:
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._started


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
        full_replan: bool = False,
        plan_limit: int | None = budget.DEFAULT_LIMIT,
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.dispatcher = dispatcher
        self.accounts = accounts
        self.victims = victims
        self.meters = meters
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.cycles = 0  # cycles run to their end
        self.cycle_number = 0  # the cycle running or last begun, logged as `cycle`
        self.queues = queues or registry.QueueRegistry()
        self.reservations: dict[str, plans.Reservation] = {}
        self.queue_gauges_every = queue_gauges_every
        self._queue_gauges_at = 0.0
        # the holdings counted again from the jobs (`Accounting.resync`) at most this often,
        # and less often when a recount would take over `RESYNC_SHARE` of the time: one of
        # 20,000 jobs holding GPUs took about 0.2 s, 4% of the loop's time every 5 s
        self.resync_every = 5.0
        self._resync_due = self.resync_every
        self.last_plan_seconds = 0.0
        self._resynced_at = time.monotonic()
        self.commit_failures = 0  # dispatch commits failed in a row: the next cycle waits
        self.full_replan = full_replan  # plan every pending job every cycle, park none
        self.plan_limit = plan_limit  # pending jobs planned per cycle (`planning.backlog.budget`)
        self.limit = plan_limit  # the next cycle's: less while planning is slow (`next_limit`)
        # changed jobs read into the backlog per cycle (reading is cheaper than planning)
        self.look_limit = 4 * (plan_limit or budget.DEFAULT_LIMIT)
        self.backlog = backlog.Backlog()  # the pending jobs, live or parked
        self.reference: parking.Reference | None = None  # what parked jobs were checked on
        self.last_cycle: parking.BacklogPlan | None = None
        # the last cycle's plan found no offer slot left: the next waits for one (`_run`)
        self.busy = False
        self.cycles_held = 0  # wakeups that ran no cycle, every agent's window still full
        self.waits = Waits()
        self.positions = positions.Positions(  # `why`'s position and ETA, read when asked
            self.backlog,
            records=jobs,
            accounts=accounts,
            clusters=clusters,
            queues=self.queues,
            version=lambda: self.cycles,
        )
        self._excluded: dict[str, frozenset[str]] = {}  # job -> clusters that rejected it
        self._dirty: set[str] = set(jobs.queued())  # jobs to look at again next cycle
        jobs.observe(self._note_change)

    def _note_change(self, change: book.Change) -> None:
        """A book observer: a job that is or was queued is looked at again next cycle."""
        before = change.before
        if change.after.status.state == JobState.QUEUED or (
            before is not None and before.status.state == JobState.QUEUED
        ):
            self._dirty.add(change.after.id)

    def close(self) -> None:
        """Stop following the book (the term ended)."""
        self.book.unobserve(self._note_change)

    def _refresh(self) -> None:
        """Bring the backlog up to date: the jobs that changed since the last cycle, and the
        ones whose excluded clusters changed (a rejection, a fresh summary)."""
        rejected: dict[str, set[str]] = {}
        for cluster in self.fleet.clusters.values():
            for job_id in cluster.rejected:
                rejected.setdefault(job_id, set()).add(cluster.name)
        excluded = {job_id: frozenset(names) for job_id, names in rejected.items()}
        for job_id in self._excluded.keys() | excluded.keys():
            if self._excluded.get(job_id) != excluded.get(job_id):
                self._dirty.add(job_id)
        self._excluded = excluded
        self._look_again()
        if not self._dirty and self.book.queued_count() != len(self.waits):
            self._dirty = set(self.book.queued() ^ self.waits.ids())  # one forgotten (`forget`)
            self._look_again()

    def _look_again(self) -> None:
        """The changed jobs into the backlog: at most `look_limit` a cycle (reading every
        job's request at once, 100,000 jobs after a start, would hold the loop for seconds),
        the rest in the next cycles, which come at once."""
        if len(self._dirty) <= self.look_limit:
            dirty, self._dirty = self._dirty, set()
        else:
            dirty = set(itertools.islice(self._dirty, self.look_limit))
            self._dirty -= dirty
            self.book.wakeup.set()
        for job_id in dirty:
            record = self.book.get(job_id)
            if record is not None and record.status.state == JobState.QUEUED:
                since = record.status.events[-1].time if record.status.events else record.created
                self.waits.put(job_id, record.job.spec.queue, since)
            else:
                self.waits.drop(job_id)
            known = self.backlog.get(job_id)
            view = self.dispatcher.view(
                job_id,
                self._excluded.get(job_id, _NONE_EXCLUDED),
                request=known.request if known is not None else None,
            )
            if view is None:
                self.backlog.drop(job_id)
            else:
                self.backlog.put(view)

    async def run_cycle(self) -> int:
        """One cycle, its lines logged with its number (`cycle`); returns the offers sent."""
        self.cycle_number += 1
        with logcontext.bind(cycle=self.cycle_number), Lap() as took:
            # 1. pending jobs: the backlog brought up to date; the holdings recounted now and then
            self._refresh()
            self._recount_holdings()
            if not len(self.backlog):
                self.reservations, self.reference, self.busy = {}, None, False
                offers = 0
            else:
                offers = await self._place()
            # 7. gauges
            self._export_gauges()
            self._export_queue_gauges()
            self.cycles += 1
            self.meters.scheduling_cycles.inc()
        self.meters.cycle_duration.observe(took.seconds)
        return offers

    async def _place(self) -> int:
        """Phases 2 to 6 of a cycle with jobs pending; returns the offers sent."""
        # 2. snapshot: the fleet less in-flight offers, the jobs holding GPUs (read if a
        # preemption search looks), the victims still releasing theirs
        running = LazyRunning(self.accounts.running_jobs)
        releasing = self.victims.releasing()
        now = time.monotonic()
        fleet = self.fleet.snapshot(now=now)
        limit = self._slice_limit(now=now)
        # 3. plan the backlog's slice; park the jobs that could not act
        with Lap() as planning_took:
            cycle = parking.plan_backlog(
                self.backlog,
                fleet,
                previous=self.reference,
                running=running,
                usage=self.accounts.usage(),
                queues=self.queues.config,
                reservations=self.reservations,
                releasing=releasing,
                now=status.utcnow(),
                park=not self.full_replan,
                limit=limit,
                array_holding=self.book.array_holding(),
            )
        plan = cycle.plan
        # 4. assume: the backlog settles, the plan's reservations and set-asides are kept
        self.backlog.settle(cycle.woken, cycle.parks)
        self.reference = cycle.reference
        self.last_cycle = cycle
        self.busy = plan.busy
        self._note_planning(cycle, seconds=planning_took.seconds)
        self.reservations = plan.reservations
        self._note_set_aside(plan, fleet)
        # 5. preempt the victims chosen
        await self.victims.preempt(plan.preemptions)
        # 6. commit Dispatched (compare-and-swap) and send the offers; a refused commit
        # leaves the jobs queued and the next cycles back off
        outcome = await self.dispatcher.dispatch(plan, images=self.queues.allowed_images)
        if cycle.deferred and not plan.busy:  # a slice of a deep backlog: plan on
            self.book.wakeup.set()  # (every agent busy: its answers wake the next cycle)
        self.commit_failures = self.commit_failures + 1 if outcome.failed else 0
        if outcome.failed:
            self.book.wakeup.set()  # plan them again once the pause is over
        return outcome.sent

    def _recount_holdings(self) -> None:
        """Count the holdings again from the jobs (`Accounting.resync`) when due: every
        `resync_every` seconds, or less often while a recount takes over `RESYNC_SHARE`."""
        if time.monotonic() - self._resynced_at <= self._resync_due:
            return
        with Lap() as took:
            self.accounts.resync()
        self._resynced_at = time.monotonic()
        self._resync_due = max(self.resync_every, took.seconds / RESYNC_SHARE)

    def _note_planning(self, cycle: parking.BacklogPlan, *, seconds: float) -> None:
        """What planning took: the decision meter, and the next cycle's budget from it."""
        self.last_plan_seconds = seconds
        if cycle.planned:
            self.meters.decision_duration.observe(seconds / len(cycle.planned))
        if self.plan_limit is not None and self.limit is not None:
            self.limit = budget.next_limit(
                self.limit, self.plan_limit, took=seconds, planned=len(cycle.planned)
            )

    def _slice_limit(self, *, now: float) -> int | None:
        """The jobs this cycle plans at most: the budget (`self.limit`), and no more than
        the offers the agents may still be sent and `SLOT_SLACK` (the jobs told they fit
        nowhere leave their slots to those behind them, planned by the next cycle, which
        follows at once). Beyond that a job could only be told ClusterBusy: under a deep
        backlog most cycles had a few slots and planned 500 jobs to send a few offers."""
        free = self.fleet.free_offer_slots(now=now)
        if free is None or self.limit is None:
            return self.limit
        return min(self.limit, free + SLOT_SLACK)

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
        now = status.utcnow()
        self.meters.parked_jobs.set(len(self.backlog.parked()))
        counts: dict[str, int] = {}  # per label: queues past the labelled ones share `other`
        ages: dict[str, float] = {}
        for queue, count in self.waits.counts.items():
            label = self.meters.queue_label(queue)
            counts[label] = counts.get(label, 0) + count
            oldest = self.waits.oldest(queue)
            if oldest is not None:
                age = max(0.0, (now - oldest).total_seconds())
                ages[label] = max(age, ages.get(label, 0.0))
        self.meters.set_pending(counts, ages)

    def _export_queue_gauges(self) -> None:
        """GPUs in use, guaranteed and fair share per queue and model (at most every
        `queue_gauges_every` seconds), from what the shell keeps: the queues' holdings
        (`accounting`) and pending jobs (the backlog), no pass over the jobs."""
        now = time.monotonic()
        if now - self._queue_gauges_at < self.queue_gauges_every:
            return
        self._queue_gauges_at = now
        views = usage.build_views(
            self.queues.config,
            running=(),
            pending=(),
            waiting=self.backlog.pending_per_queue(),
            usage=self.accounts.usage(),
            fleet_gpus=self.fleet.total_gpus(now=now),
        )
        for gauge in (
            self.meters.queue_gpus_in_use,
            self.meters.queue_gpus_guaranteed,
            self.meters.queue_gpus_fair_share,
            self.meters.queue_dominant_share,
        ):
            gauge.clear()
        shares: dict[str, float] = {}  # per label (`other`: the largest of its queues)
        for view in views:
            label = self.meters.queue_label(view.name)
            shares[label] = max(view.status.dominant_share, shares.get(label, 0.0))
            for item in view.status.gpus:
                labels = {"queue": label, "model": item.model}
                self.meters.queue_gpus_in_use.labels(**labels).inc(item.in_use)
                self.meters.queue_gpus_guaranteed.labels(**labels).inc(item.guaranteed)
                self.meters.queue_gpus_fair_share.labels(**labels).inc(item.fair_share)
        for label, share in shares.items():
            self.meters.queue_dominant_share.labels(queue=label).set(share)
        self.meters.reservations.set(len(self.reservations))

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.close()

    def _waits_for_slots(self, *, since: float) -> bool:
        """Whether a wakeup runs no cycle: the last plan was `busy` (no agent had an offer
        slot left), none has one now, and a cycle ran less than `max_interval` ago. Such a
        cycle could send nothing: it planned its whole slice only to tell each job
        ClusterBusy (in a 20,000-job soak, most cycles of the burst sent no offer, woken by
        summaries and new jobs). An answer frees a slot and wakes the next; preemptions,
        reservations and `why` wait for it, or for `max_interval` at most."""
        if not self.busy:
            return False
        now = time.monotonic()
        if now - since >= self.max_interval:
            return False
        return self.fleet.free_offer_slots(now=now) == 0

    async def _run(self) -> None:
        wakeups = (self.book.wakeup, self.fleet.changed)
        ran_at = time.monotonic()
        while True:
            timeout = self.max_interval
            if self.busy:  # held cycles still run once `max_interval` has passed
                timeout = max(0.0, ran_at + self.max_interval - time.monotonic())
            waiters = [asyncio.ensure_future(e.wait()) for e in wakeups]
            try:
                await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
            for event in wakeups:
                event.clear()
            if self._waits_for_slots(since=ran_at):
                self.cycles_held += 1
                continue
            ran_at = time.monotonic()
            self.last_plan_seconds = 0.0
            try:
                await self.run_cycle()
            except Exception:
                self.commit_failures += 1  # whatever broke, the next cycles wait longer
                self.meters.background_errors.labels(task="scheduler").inc()
                logger.exception("scheduling cycle failed", extra={"cycle": self.cycle_number})
            # long planning (a deep backlog) is followed by a pause as long (at most 2 s):
            # planning never takes more than half of the broker's time, and the rest of the
            # broker (the leader's lease, agents' reports, the API) is never starved of it
            pause = min(self.last_plan_seconds, 2.0)
            if self.commit_failures:  # the store refuses dispatches: back off, up to 2 s
                pause = max(pause, min(2.0, 0.05 * 2 ** min(self.commit_failures, 6)))
            await asyncio.sleep(max(self.min_interval, pause))


RESYNC_SHARE = 0.01  # of the scheduler's time the recount of holdings may take
SLOT_SLACK = 50  # jobs a cycle plans past the offer slots free (`Scheduler._slice_limit`)
STOP_SECONDS = tasks.STOP_SECONDS


async def stop_task(task: asyncio.Task[None], *, timeout: float = STOP_SECONDS) -> bool:
    """Cancel `task` and wait for it to end (`kits.tasks.stop_task`): a task that swallows its
    cancellation must not hold up the end of a term, and with it every term after (the
    replica would lead without working). A store error it had ended with (the retirer ends
    itself with NotLeaderError when a fenced write finds the term over) is only a warning."""
    return await tasks.stop_task(task, timeout=timeout, expected=(errors.StoreError,))
