"""Active deadlines: a job past its `failurePolicy.activeDeadlineSeconds` fails, its pods go.

A job's deadline is its first start (the first Running event, over all its attempts) plus
its `activeDeadlineSeconds`, each replica counting it on its own clock (`local_deadline`): the
replica whose book recorded the first start counts from that event's time (its own clock);
a replica that learns of it from another's commit (the watch) counts from when it learned
it. A follower that becomes leader thus never compares a time stamped by another host with
its own clock: a leader whose clock runs ahead of the old one's does not fail jobs early by
the difference. Only a replica that loads a job already started (it restarted) counts from
the stored time: there the replicas' clocks must agree (NTP), and a skew of s seconds moves
that job's deadline by s. A watch that lags makes a deadline late by the lag, never early.
`Deadlines` is a book observer on every replica (it keeps
the unfinished jobs that have a deadline, by job: O(those jobs), nothing for the others) and,
on the leader (`dispatch.leading`), a task: when a deadline passes it commits the job Failed
(`DeadlineExceeded`, fenced by the term) and then sends the job's agent a Cancel of that
attempt (reason `DeadlineExceeded`) so its pods are deleted. A job queued again after a
failure or a preemption keeps its deadline and fails in the queue. An agent that is away
when the Cancel is sent deletes the pods on its return: its hello lists an attempt the
broker has finished, which `reports.hello` cancels as stale.

The pass runs when the earliest deadline is due (at most a second between passes, so a job
whose deadline just got known waits no longer). A store error is logged and counted
(`gpufed_background_errors{task="deadlines"}`) and the passes back off while it lasts: the
task never dies of one. Named for what it keeps rather than as a gerund: `expiring` is the
sweep of idempotency keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from broker.api import status
from broker.jobs import book, fleet, passes, transitions
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

TASK = "deadlines"
MAX_PAUSE_SECONDS = 1.0
MIN_PAUSE_SECONDS = 0.05
BATCH = 500  # jobs failed per commit, at most


def local_deadline(
    change: book.Change, *, now: datetime, known: datetime | None = None
) -> datetime | None:
    """When the job of `change` passes its active deadline, on this replica's clock (`now`
    read from it); None when it has none (no `activeDeadlineSeconds`, not started yet,
    finished or being cancelled). `known`: the deadline this replica set before, kept.

    The first start as the change shows it is counted from the event's time when this
    replica recorded it (its own clock), from `now` when it learns of it from another
    replica's commit (that replica's clock is not this one's), and from the stored time when
    the job was already started the first time this replica saw it (a load)."""
    record = change.after
    policy = record.job.spec.failure_policy
    if policy is None or policy.active_deadline_seconds is None:
        return None  # most jobs: their events are not read
    if record.status.state.terminal or record.status.cancel_requested:
        return None
    started = transitions.first_started(record)
    if started is None:
        return None
    if known is not None:
        return known
    seconds = timedelta(seconds=policy.active_deadline_seconds)
    before = change.before
    if change.remote and before is not None and transitions.first_started(before) is None:
        return now + seconds  # learned of the start now, from another replica's clock
    return started + seconds


class Deadlines:
    """The unfinished jobs with an active deadline, and the leader's task that enforces it."""

    def __init__(
        self,
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        clock: Callable[[], datetime] = status.utcnow,
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.meters = meters
        self.clock = clock
        self.due: dict[str, datetime] = {}  # job id -> when its deadline passes (this clock)
        self.expired = 0  # jobs this replica failed for their deadline

    def __call__(self, change: book.Change) -> None:
        job_id = change.after.id
        deadline = local_deadline(change, now=self.clock(), known=self.due.get(job_id))
        if deadline is None:
            self.due.pop(job_id, None)
        else:
            self.due[job_id] = deadline

    def next_due(self) -> datetime | None:
        return min(self.due.values(), default=None)

    async def expire_once(self, *, now: datetime | None = None) -> int:
        """Fail the jobs whose deadline has passed and cancel their pods; how many failed."""
        moment = now or self.clock()
        passed = sorted(job_id for job_id, at in self.due.items() if at <= moment)[:BATCH]
        if not passed:
            return 0
        async with self.book.lock:
            drafts: list[tuple[status.JobRecord, str | None]] = []
            for job_id in passed:
                record = self.book.latest(job_id)
                if record is None or record.status.state.terminal or record.status.cancel_requested:
                    self.due.pop(job_id, None)
                    continue
                deadline = self.due.get(job_id)
                if deadline is None or deadline > moment:
                    continue
                holding = record.status.state in book.HOLDING
                draft = book.draft_of(record)
                transitions.exceed_deadline(draft, now=moment)
                drafts.append((draft, record.status.cluster if holding else None))
            if not drafts:
                return 0
            try:
                await self.book.commit([draft for draft, _ in drafts])
            finally:
                # the transactions that went through, even if another one failed
                done = [(d, c) for d, c in drafts if self.book.get(d.id) is d]
                for draft, cluster in done:
                    logger.info(
                        "job %s failed: %s",
                        draft.id,
                        draft.status.events[-1].message,
                        extra={"job_id": draft.id},
                    )
                    if cluster is not None:
                        await self.fleet.send_cancel(
                            cluster,
                            draft.id,
                            epoch=draft.status.epoch,
                            reason=transitions.DEADLINE_EXCEEDED,
                            attempt=transitions.attempt_of(draft),
                        )
                self.expired += len(done)
        return len(done)

    def pause(self, *, now: datetime) -> float:
        """Seconds until the next pass: the earliest deadline, within bounds."""
        soonest = self.next_due()
        if soonest is None:
            return MAX_PAUSE_SECONDS
        wait = (soonest - now).total_seconds()
        return min(MAX_PAUSE_SECONDS, max(MIN_PAUSE_SECONDS, wait))

    async def run(self) -> None:
        """Enforce deadlines until cancelled (the leader's task)."""

        async def step() -> float:
            await self.expire_once()
            return self.pause(now=self.clock())

        await passes.run_passes(
            step,
            what="failing jobs past their deadline",
            on_error=self.meters.background_errors.labels(task=TASK).inc,
            pause_after_error=MAX_PAUSE_SECONDS,
        )
