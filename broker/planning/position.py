"""A queued job's place in line and when it may start: what `GET /v1/jobs/{id}/why` adds
(`position`, `eta`). Pure: no await, no clock, no I/O.

Called by `jobs.positions` on the leader with the scheduler's backlog (the queued jobs as
the planner sees them), the GPUs free now and the running jobs with their expected ends.

**Position.** In its queue: 1 + the queued jobs of its queue ahead of it in the planner's
order within a queue (higher effective priority, then earlier submission, then id), any
model. Among competing jobs: 1 + the queued jobs of any queue that may use one of the GPU
models it may use and that the planner would take first as far as it is known: a higher
priority first; at equal priority the queue with the lower dominant share now (fair share;
within one queue: submission); then the earlier submission. It is an estimate: the planner
also puts jobs within their guarantee first (tier 0), and shares change as jobs are placed.
For one job, the jobs ahead of it in another queue are a prefix of that queue's order, so
the index keeps each (queue, models) group sorted with running sums of GPUs: a question
costs O(groups × log jobs) once the index is built (O(jobs × log jobs), once per cycle).

**ETA.** A first-come simulation over GPU counts: the GPUs of its models free now, then
those the running jobs on its models free at their expected ends (earliest first); the
competing jobs ahead of it start in their order as soon as enough are free, and free theirs
again after their declared run time (one that declares none keeps them); the job starts when
its turn comes and its GPUs are free. GPUs only: quotas, node fragmentation, topology and
backfilling are not counted (the reasons say when those hold it). When the GPUs run out
before its turn: no ETA, and the reason says why.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

Order = tuple[int, datetime, str]  # (-priority, created, id): the place in its queue


@dataclass(frozen=True)
class Queued:
    """A queued job as the position counts it."""

    job_id: str
    queue: str
    priority: int  # effective (its class, its number, its queue's class)
    created: datetime
    gpus: int  # the whole gang's
    models: frozenset[str]  # the fleet's GPU models it may use
    seconds: float | None = None  # how long it runs once started, if it declares it

    @property
    def order(self) -> Order:
        return (-self.priority, self.created, self.job_id)


@dataclass(frozen=True)
class Ending:
    """A job holding GPUs and when it is expected to end (None: it does not say)."""

    job_id: str
    gpus: Mapping[str, int]  # model -> GPUs held
    ends: datetime | None


@dataclass(frozen=True)
class Position:
    in_queue: int  # 1: next in its queue
    competing: int  # 1: next of every queue's jobs wanting its models
    gpus_ahead: int  # GPUs the competing jobs ahead of it ask for


@dataclass(frozen=True)
class Estimate:
    eta: datetime | None
    reason: str | None = None  # why there is no ETA


class _Group:
    """One queue's queued jobs that may use the same models, in queue order."""

    def __init__(self, jobs: list[Queued]) -> None:
        jobs.sort(key=lambda j: j.order)
        self.jobs = jobs
        self.orders = [j.order for j in jobs]
        self.ranks = [order[0] for order in self.orders]  # -priority, ascending
        self.sums = [0, *itertools.accumulate(j.gpus for j in jobs)]

    def before(self, order: Order) -> tuple[int, int]:
        """How many jobs (and their GPUs) come before `order` in the queue."""
        at = bisect.bisect_left(self.orders, order)
        return at, self.sums[at]

    def above(self, priority: int, *, equal: bool) -> tuple[int, int]:
        """How many jobs (and their GPUs) have a priority above `priority` (or equal)."""
        at = bisect.bisect_left(self.ranks, -priority + 1 if equal else -priority)
        return at, self.sums[at]


class PositionIndex:
    """The queued jobs grouped by (queue, models), each group in queue order."""

    def __init__(self, queued: Iterable[Queued]) -> None:
        self.jobs: dict[str, Queued] = {}
        grouped: dict[tuple[str, frozenset[str]], list[Queued]] = {}
        for job in queued:
            self.jobs[job.job_id] = job
            grouped.setdefault((job.queue, job.models), []).append(job)
        self._groups = {key: _Group(jobs) for key, jobs in grouped.items()}

    def __len__(self) -> int:
        return len(self.jobs)

    def locate(self, job_id: str, *, shares: Mapping[str, float]) -> Position | None:
        """The job's position (None: not in the index); `shares`: the queues' dominant
        shares now (a queue missing holds nothing: 0)."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        in_queue = competing = gpus = 0
        for (queue, models), _, (count, held) in self._ahead(job, shares):
            if queue == job.queue:
                in_queue += count
            if models & job.models:
                competing, gpus = competing + count, gpus + held
        return Position(in_queue=in_queue + 1, competing=competing + 1, gpus_ahead=gpus)

    def ahead(self, job_id: str, *, shares: Mapping[str, float]) -> list[Queued]:
        """The competing jobs ahead of it, in the order they would go: priority, then the
        queue's share, then submission. O(those jobs × log)."""
        job = self.jobs[job_id]
        out: list[Queued] = []
        for (_, models), group, (count, _) in self._ahead(job, shares):
            if models & job.models:
                out.extend(group.jobs[:count])
        out.sort(key=lambda j: (-j.priority, shares.get(j.queue, 0.0), j.created, j.job_id))
        return out

    def _ahead(
        self, job: Queued, shares: Mapping[str, float]
    ) -> Iterator[tuple[tuple[str, frozenset[str]], _Group, tuple[int, int]]]:
        """Per group of its queue or of its models: how many go first (and their GPUs)."""
        own = shares.get(job.queue, 0.0)
        for key, group in self._groups.items():
            queue, models = key
            if queue == job.queue:
                yield key, group, group.before(job.order)
                continue
            if not models & job.models:
                continue
            share = shares.get(queue, 0.0)
            if share < own:  # its queue goes first at equal priority
                yield key, group, group.above(job.priority, equal=True)
            elif share > own:  # only a higher priority goes first
                yield key, group, group.above(job.priority, equal=False)
            else:
                yield key, group, group.before(job.order)


def locate(
    job_id: str, queued: Iterable[Queued], *, shares: Mapping[str, float]
) -> Position | None:
    """`PositionIndex(queued).locate(job_id)`: one question, one index."""
    return PositionIndex(queued).locate(job_id, shares=shares)


def estimate_start(
    job: Queued,
    *,
    ahead: Sequence[Queued],
    free: Mapping[str, int],
    running: Sequence[Ending],
    now: datetime,
) -> Estimate:
    """When enough GPUs of the job's models are free for it, the jobs ahead of it (in
    their order) having started before it and ended after their declared run time."""
    if not job.gpus:
        return Estimate(None, "it asks for no GPU: nothing to wait for but the reasons")
    if not job.models:
        return Estimate(None, "no GPU model of the fleet suits it")
    pool = sum(free.get(model, 0) for model in job.models)
    holding = [(e, sum(n for m, n in e.gpus.items() if m in job.models)) for e in running]
    releases = [(max(e.ends, now), e.job_id, n) for e, n in holding if n > 0 and e.ends]
    heapq.heapify(releases)
    at = now
    for other in [*ahead, job]:
        while pool < other.gpus:
            if not releases:
                return Estimate(None, _stalled(holding, job=job, blocked=other))
            ends, _, count = heapq.heappop(releases)
            at, pool = max(at, ends), pool + count
        if other is job:
            return Estimate(at)
        pool -= other.gpus
        if other.seconds is not None:
            heapq.heappush(
                releases, (at + timedelta(seconds=other.seconds), other.job_id, other.gpus)
            )
    raise AssertionError("the job itself ends the loop")


def _stalled(holding: Sequence[tuple[Ending, int]], *, job: Queued, blocked: Queued) -> str:
    if not any(n > 0 for _, n in holding):
        return "no job runs on the GPU models it needs"
    if not any(n > 0 and e.ends is not None for e, n in holding):
        return "no running job on the GPU models it needs declares when it ends"
    whose = "it" if blocked is job else f"the job ahead of it {blocked.job_id}"
    return (
        f"the GPUs of its models free now and at the declared ends of the jobs holding them "
        f"(the running ones, and those ahead of it with a declared run time) do not reach the "
        f"{blocked.gpus} {whose} needs"
    )
