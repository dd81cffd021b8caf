"""A queued job's position and ETA for `GET /v1/jobs/{id}/why`, from what the leader's
scheduler holds: its backlog (the queued jobs as the planner sees them), the fleet's free
GPUs, the queues' holdings and the jobs holding GPUs with their expected ends. The
arithmetic is `planning.position`'s; here is what it is fed and how often.

Cost: the index (every queued job grouped by queue and models, sorted) and the running
jobs' ends are read once per scheduling cycle, on the first question after it (O(queued
jobs × log) and O(jobs holding GPUs); a job's models and run time are read once per
request it has); the backlog changes only in a cycle. Each question after that costs
O(groups × log queued jobs) for the position and O((jobs ahead of it + jobs holding GPUs)
× log) for the ETA, no ETA past `MAX_AHEAD` jobs ahead. Nothing is read when nobody asks.

What declares an end: `spec.failurePolicy.activeDeadlineSeconds` (from the job's first
start: the broker fails it then, so it ends by then at the latest) and the
`gpufed.io/sim-duration` annotation of its pod templates (the simulated backend runs the
pods that long, the longest task's counting, from when the job last started); the earlier
of the two. A job holding GPUs without either does not say when it ends. A queued job ahead
runs, once started, for the shorter of the two (`run_seconds`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from broker.api import jobs, status
from broker.jobs import accounting, book, fleet, transitions
from broker.planning import fairshare, position, quotas, snapshot
from broker.planning.backlog import backlog
from broker.state import registry

MAX_AHEAD = 2000  # competing jobs ahead of it past which no ETA is simulated


@dataclass(frozen=True)
class Answer:
    position: position.Position | None
    models: tuple[str, ...] = ()
    eta: datetime | None = None
    reason: str | None = None  # why there is no position or no ETA


@dataclass(frozen=True)
class _View:
    index: position.PositionIndex
    shares: dict[str, float]
    free: dict[str, int]
    running: list[position.Ending]


class Positions:
    def __init__(
        self,
        pending: backlog.Backlog,
        *,
        records: book.JobBook,
        accounts: accounting.Accounting,
        clusters: fleet.Fleet,
        queues: registry.QueueRegistry,
        version: Callable[[], int],
    ) -> None:
        self.pending = pending
        self.records = records
        self.accounts = accounts
        self.clusters = clusters
        self.queues = queues
        self.version = version  # the scheduler's cycle count: the backlog changed with it
        self._view: tuple[int, _View] | None = None
        # job -> (its request, its models, its declared run time): read once per request
        self._known: dict[str, tuple[object, frozenset[str], float | None]] = {}
        self.builds = 0  # views read (the tests count them)

    def answer(self, job_id: str, *, now: datetime) -> Answer:
        """The job's position and ETA; no position if the scheduler does not hold it yet."""
        view = self._current(now)
        located = view.index.locate(job_id, shares=view.shares)
        if located is None:
            return Answer(None, reason="not in the scheduler's backlog yet: ask again shortly")
        job = view.index.jobs[job_id]
        if located.competing > MAX_AHEAD:
            reason = f"more than {MAX_AHEAD} jobs ahead of it: no estimate"
            return Answer(located, tuple(sorted(job.models)), None, reason)
        estimate = position.estimate_start(
            job,
            ahead=view.index.ahead(job_id, shares=view.shares),
            free=view.free,
            running=view.running,
            now=now,
        )
        return Answer(located, tuple(sorted(job.models)), estimate.eta, estimate.reason)

    def _current(self, now: datetime) -> _View:
        version = self.version()
        if self._view is None or self._view[0] != version:
            self._view = (version, self._build(now))
        return self._view[1]

    def _build(self, now: datetime) -> _View:
        self.builds += 1
        fleet_now = self.clusters.snapshot(now=time.monotonic())
        fleet_models = {m for c in fleet_now.clusters.values() for m in c.models}
        free: dict[str, int] = {}
        for cluster in fleet_now.clusters.values():
            for name, model in cluster.models.items():
                free[name] = free.get(name, 0) + model.free_gpus
        tenancy = quotas.Tenancy(self.queues.config)
        known: dict[str, tuple[object, frozenset[str], float | None]] = {}
        queued = []
        for job_id in self.pending.ids():
            job = self.pending.get(job_id)
            if job is None:
                continue
            found = self._known.get(job_id)
            if found is None or found[0] is not job.request:
                record = self.records.get(job_id)
                models = quotas.allowed_models(job.request, fleet_models)
                found = (job.request, models, run_seconds(record) if record else None)
            known[job_id] = found
            queued.append(_queued(job, tenancy, found[1], found[2]))
        self._known = known
        index = position.PositionIndex(queued)
        ledger = quotas.Ledger.build(
            tenancy, (), fleet_now.total_gpus(), usage=self.accounts.usage()
        )
        shares = {q: fairshare.dominant_share(ledger, q) for q in {j.queue for j in queued}}
        running = [self._ending(job, now=now) for job in self.accounts.running_jobs()]
        return _View(index, shares, free, running)

    def _ending(self, job: snapshot.RunningJob, *, now: datetime) -> position.Ending:
        record = self.records.get(job.job_id)
        ends = expected_end(record, started=job.started or now) if record is not None else None
        return position.Ending(job.job_id, job.gpus, ends)


def _queued(
    job: snapshot.PendingJob,
    tenancy: quotas.Tenancy,
    models: frozenset[str],
    seconds: float | None,
) -> position.Queued:
    return position.Queued(
        job_id=job.job_id,
        queue=job.queue,
        priority=tenancy.priority_of(job.queue, job.priority, job.priority_class),
        created=job.created,
        gpus=quotas.gpus_of(job.request),
        models=models,
        seconds=seconds,
    )


def expected_end(record: status.JobRecord, *, started: datetime) -> datetime | None:
    """When a job holding GPUs is expected to end, if it declares it (the module's
    docstring): the earlier of its active deadline and its start plus its run time."""
    ends = [transitions.active_deadline(record)]
    seconds = sim_run_seconds(record)
    if seconds is not None:
        ends.append(started + timedelta(seconds=seconds))
    found = [end for end in ends if end is not None]
    return min(found) if found else None


def run_seconds(record: status.JobRecord) -> float | None:
    """How long a queued job runs once started, if it declares it: the shorter of its
    `activeDeadlineSeconds` and its pods' `gpufed.io/sim-duration` (the longest task's)."""
    policy = record.job.spec.failure_policy
    deadline = policy.active_deadline_seconds if policy is not None else None
    found = [s for s in (deadline, sim_run_seconds(record)) if s is not None]
    return float(min(found)) if found else None


def sim_run_seconds(record: status.JobRecord) -> float | None:
    """The longest `gpufed.io/sim-duration` of the job's tasks (None: none declares one)."""
    seconds = [sim_seconds(task.template.metadata.annotations) for task in record.job.spec.tasks]
    declared = [s for s in seconds if s is not None]
    return max(declared) if declared else None


def sim_seconds(annotations: dict[str, str]) -> float | None:
    """Seconds of a `gpufed.io/sim-duration` (`12`, `1.5`, `30s`, `5m`, `2h`); None: absent
    or not a duration (a record stored before the annotation was checked)."""
    raw = annotations.get(jobs.SIM_DURATION_ANNOTATION)
    if raw is None:
        return None
    text = raw.strip()
    factor = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1:], 0.0)
    try:
        value = float(text[:-1] if factor else text) * (factor or 1.0)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
