"""Start timeouts: a job dispatched and not Running within the broker's start timeout is
withdrawn from its cluster and queued again (`StartTimeout`).

A cluster answers for what it accepts. Pods that stay Pending for good (a quota or an
admission webhook that refuses them, an image that never pulls), or an agent that accepts and
never starts anything, would otherwise hold the job, and the GPUs the broker counts for it,
with no end. `Starts` is a book observer on every replica (it keeps the Dispatched jobs, by
job: O(those jobs)) and, on the leader (`dispatch.leading`), a task: once a job's timeout
passes (`fleet.Fleet.start_timeout`, `--start-timeout`) it commits the job Queued again
(reason `StartTimeout`, the cluster excluded for it until a newer summary, as after a
rejection), then sends the agent a Cancel of that attempt (reason `StartTimeout`) so its pods
are deleted, and gives the cluster a strike (`fleet.Fleet.strike`): a cluster that keeps
failing to start jobs is scored down for a while (`planning.standing`).

The timeout counts from the job's dispatch as its events record it (the latest `Dispatched`
event), so a leader that takes over finds the same start times in the records it loads. The
time left is measured once, when this replica first sees the job Dispatched (its wall clock
against the event's time), and counted on from there on its monotonic clock, so that a jump
of the wall clock later changes nothing. On the leader that dispatched the job both times
come from one clock. After a failover they come from two hosts: a new leader whose clock runs
ahead of the old one's by s withdraws the jobs dispatched before the failover s seconds early
(at takeover at the soonest), one whose clock runs behind withdraws them s seconds late (at
most a whole timeout after takeover). NTP keeps s to milliseconds, against a timeout of
minutes.

Jobs of a cluster whose agent is away are not withdrawn: the lost-cluster grace decides about
them (the agent fences itself first); they are withdrawn once it is back, if still not
Running. An offer not answered yet is the offer timeout's (`reports.withdraw_unanswered`). A
job asked to cancel is left to its cancel. A store error is logged and counted
(`gpufed_background_errors{task="start-timeouts"}`) and the passes back off while it lasts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

from broker.api import status
from broker.api.status import JobState
from broker.jobs import book, fleet, passes, transitions
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

TASK = "start-timeouts"
START_TIMEOUT = "StartTimeout"
DISPATCHED = "Dispatched"  # the reason of a dispatch's event (`transitions.dispatch`)
MAX_PAUSE_SECONDS = 1.0
MIN_PAUSE_SECONDS = 0.05
BATCH = 500  # jobs withdrawn per commit, at most


def dispatched_at(record: status.JobRecord) -> datetime | None:
    """When the job's latest dispatch was recorded (None: it has none)."""
    for event in reversed(record.status.events):
        if event.state == JobState.DISPATCHED and event.reason == DISPATCHED:
            return event.time
    return None


def last_withdrawal(record: status.JobRecord) -> str | None:
    """The latest StartTimeout of the job in words (`why` of a job that runs elsewhere now)."""
    for event in reversed(record.status.events):
        if event.reason == START_TIMEOUT:
            return f"{START_TIMEOUT}: {event.message}"
    return None


class Starts:
    """The Dispatched jobs and when their start timeout passes; the leader's task that
    withdraws them."""

    def __init__(
        self,
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = status.utcnow,
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.meters = meters
        self.clock = clock
        self.wall = wall
        # job id -> (its attempt, when its start timeout passes: monotonic)
        self.due: dict[str, tuple[int, float]] = {}
        self.withdrawn = 0  # jobs this replica withdrew for their start timeout

    def __call__(self, change: book.Change) -> None:
        record = change.after
        if record.status.state != JobState.DISPATCHED or record.status.cancel_requested:
            if self.due:
                self.due.pop(record.id, None)
            return
        attempt = record.status.attempts
        known = self.due.get(record.id)
        if known is not None and known[0] == attempt:
            return  # seen Dispatched already (its pods named, a reconnect)
        at = dispatched_at(record)
        if at is None:
            self.due.pop(record.id, None)
            return
        timeout = self.fleet.start_timeout
        # the wall clocks of the leader that dispatched it and of this replica: see above
        age = min(max((self.wall() - at).total_seconds(), 0.0), timeout)
        self.due[record.id] = (attempt, self.clock() + timeout - age)

    def pause(self, *, now: float) -> float:
        """Seconds until the next pass: the next timeout to pass, within bounds."""
        soonest = min((at for _, at in self.due.values() if at > now), default=None)
        if soonest is None:
            return MAX_PAUSE_SECONDS
        return min(MAX_PAUSE_SECONDS, max(MIN_PAUSE_SECONDS, soonest - now))

    def _withdrawable(self, job_id: str) -> tuple[status.JobRecord, fleet.Cluster] | None:
        """The job and its cluster if its start timeout passed and it is to be withdrawn now."""
        record = self.book.latest(job_id)
        if (
            record is None
            or record.status.state != JobState.DISPATCHED
            or record.status.cancel_requested
        ):
            self.due.pop(job_id, None)
            return None
        cluster = self.fleet.clusters.get(record.status.cluster or "")
        if cluster is None or cluster.link is None or transitions.is_waiting_for_cluster(record):
            return None  # away: the lost-cluster grace decides; looked at again once back
        flight = cluster.inflight.get(job_id)
        if flight is not None and not flight.accepted:
            return None  # not answered yet: the offer timeout's
        return record, cluster

    async def withdraw_once(self, *, now: float | None = None) -> int:
        """Withdraw the jobs whose start timeout has passed; how many."""
        moment = self.clock() if now is None else now
        passed = sorted(job_id for job_id, (_, at) in self.due.items() if at <= moment)[:BATCH]
        if not passed:
            return 0
        timeout = self.fleet.start_timeout
        async with self.book.lock:
            drafts: list[tuple[status.JobRecord, fleet.Cluster]] = []
            for job_id in passed:
                found = self._withdrawable(job_id)
                if found is None:
                    continue
                record, cluster = found
                pods = record.status.pods
                running = sum(pod.phase == status.PodPhase.RUNNING for pod in pods)
                named = f"{running} of {len(pods)} pods Running" if pods else "no pods named"
                said = next((f"; pod {p.name}: {p.reason}" for p in pods if p.reason), "")
                text = (
                    f"{cluster.name}: not Running within {timeout:g} s of its dispatch "
                    f"({named}{said}); withdrawn"
                )
                draft = book.draft_of(record)
                draft.status.reasons = [text]
                transitions.requeue(draft, START_TIMEOUT, text)
                drafts.append((draft, cluster))
            if not drafts:
                return 0
            try:
                await self.book.commit([draft for draft, _ in drafts])
            finally:
                # the transactions that went through, even if another one failed
                done = [(d, c) for d, c in drafts if self.book.get(d.id) is d]
                for draft, cluster in done:
                    await self._withdrawn(draft, cluster)
                self.withdrawn += len(done)
        return len(done)

    async def _withdrawn(self, draft: status.JobRecord, cluster: fleet.Cluster) -> None:
        """Committed Queued: the cluster passed over for it until a newer summary, a strike,
        its pods deleted."""
        self.due.pop(draft.id, None)
        cluster.inflight.pop(draft.id, None)
        cluster.rejected[draft.id] = cluster.summary.seq if cluster.summary else 0
        self.meters.placements.labels(cluster=cluster.name, result="start_timeout").inc()
        logger.warning(
            "job %s withdrawn: %s",
            draft.id,
            draft.status.events[-1].message,
            extra={"job_id": draft.id, "cluster": cluster.name},
        )
        self.fleet.strike(cluster, f"job {draft.id} not Running in time", now=self.clock())
        await self.fleet.send_cancel(
            cluster.name,
            draft.id,
            epoch=draft.status.epoch,
            reason=START_TIMEOUT,
            attempt=transitions.attempt_of(draft),
        )

    async def run(self) -> None:
        """Withdraw the jobs past their start timeout until cancelled (the leader's task)."""

        async def step() -> float:
            await self.withdraw_once()
            return self.pause(now=self.clock())

        await passes.run_passes(
            step,
            what="withdrawing late starts",
            on_error=self.meters.background_errors.labels(task=TASK).inc,
            pause_after_error=MAX_PAUSE_SECONDS,
        )
