"""Active deadlines: a job past its `failurePolicy.activeDeadlineSeconds` fails, its pods go.

A job's deadline is its first start (the first Running event, over all its attempts) plus
its `activeDeadlineSeconds` (`transitions.active_deadline`): computed from the times stored
with the job, so a broker that restarts, or a replica that becomes leader, finds the same
deadlines in the records it loads. `Deadlines` is a book observer on every replica (it keeps
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

import asyncio
import logging
from datetime import datetime

from broker.api import status
from broker.jobs import book, fleet, transitions
from broker.state import errors
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

TASK = "deadlines"
MAX_PAUSE_SECONDS = 1.0
MIN_PAUSE_SECONDS = 0.05
MAX_BACKOFF_SECONDS = 30.0
BATCH = 500  # jobs failed per commit, at most


class Deadlines:
    """The unfinished jobs with an active deadline, and the leader's task that enforces it."""

    def __init__(
        self, jobs: book.JobBook, clusters: fleet.Fleet, *, meters: metrics.BrokerMetrics
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.meters = meters
        self.due: dict[str, datetime] = {}  # job id -> when its deadline passes
        self.expired = 0  # jobs this replica failed for their deadline

    def __call__(self, change: book.Change) -> None:
        record = change.after
        deadline = None
        if not record.status.state.terminal and not record.status.cancel_requested:
            deadline = transitions.active_deadline(record)
        if deadline is None:
            self.due.pop(record.id, None)
        else:
            self.due[record.id] = deadline

    def next_due(self) -> datetime | None:
        return min(self.due.values(), default=None)

    async def expire_once(self, *, now: datetime | None = None) -> int:
        """Fail the jobs whose deadline has passed and cancel their pods; how many failed."""
        moment = now or status.utcnow()
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
                deadline = transitions.active_deadline(record)
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
        failures = 0
        while True:
            pause = MAX_PAUSE_SECONDS
            try:
                await self.expire_once()
                pause = self.pause(now=status.utcnow())
                failures = 0
            except errors.NotLeaderError:
                raise  # the term ended: the leader's work stops this task
            except errors.StoreError as exc:
                failures += 1
                logger.warning("failing jobs past their deadline (%d in a row): %s", failures, exc)
            except Exception:  # a bug here must not end the deadlines for the term
                failures += 1
                logger.exception("failing jobs past their deadline (%d in a row)", failures)
            if failures:
                pause = min(MAX_BACKOFF_SECONDS, 2.0**failures / 4)
                self.meters.background_errors.labels(task=TASK).inc()
            await asyncio.sleep(pause)
