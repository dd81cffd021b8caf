"""What users ask of their jobs: submit and cancel. Called by `http/` via `service`.

A submit is stored as Queued, or Waiting when it has dependencies (group-committed with the
submits arriving with it; a batch's jobs all together, `submit_many`) before it is
answered; a cancel is committed before the agent is asked to delete the pods, and the job
ends Cancelled when the agent reports them gone (a queued or waiting job: at once). A job
waiting on a lost cluster (`failurePolicy.clusterLost: wait`) ends Cancelled at once: no
agent can be asked, and the one that returns is told to delete the pods (they are a stale
copy by then).

Any replica takes submits and cancels: a cancel is a plain compare-and-swap (not fenced by
the leader's term: it decides no placement), tried again from the store's record if another
replica changed the job meanwhile. The leader sends the agent the Cancel of one a follower
committed (`ForwardedCancels`, an observer of the book: followers hold no agent sessions).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from broker.api import errors as api_errors
from broker.api import status
from broker.api.status import JobState
from broker.jobs import book, fleet, transitions
from broker.state import errors
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

CANCEL_ATTEMPTS = 3  # a cancel racing other replicas' writes of the job decides again


class Requests:
    def __init__(
        self, jobs: book.JobBook, clusters: fleet.Fleet, *, meters: metrics.BrokerMetrics
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.meters = meters

    async def submit(self, record: status.JobRecord) -> status.JobRecord:
        """Store a new job; with its idempotency key used already, the job stored then."""
        [result] = await self.submit_many([record])
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_many(
        self, new: Sequence[status.JobRecord]
    ) -> list[status.JobRecord | Exception]:
        """Store new jobs together (a batch: one group commit, `book.create_many`); each
        answered on its own, in order: the job stored, its key's job, or what refused it."""
        for record in new:
            if record.status.dependencies:  # resolved at submit (`dependents.resolve`)
                text = "accepted by the broker; waiting for its dependencies (spec.dependsOn)"
                record.record(JobState.WAITING, "Submitted", text)
            else:
                record.record(JobState.QUEUED, "Submitted", "accepted by the broker")
        results = await self.book.create_many(new)
        for record, result in zip(new, results, strict=True):
            if result is record:
                self.meters.count_submitted(self.meters.queue_label(record.job.spec.queue))
        return results

    async def cancel(
        self, job_id: str, *, reason: str = "Cancelled", by: str | None = None
    ) -> status.JobRecord | None:
        """Cancel a job; returns it as committed (None if the book does not have it). `by`:
        who asked (the event that records the cancel says it).
        Another replica's write of the job in between: decided again on the record as the
        store has it now (the conflict read it again); Unavailable if that keeps happening."""
        found = await self._cancel_retrying([job_id], f"job {job_id}", reason=reason, by=by)
        return found[0] if found else None

    async def cancel_many(
        self, job_ids: Sequence[str], *, reason: str = "Cancelled", by: str | None = None
    ) -> list[status.JobRecord]:
        """Cancel these jobs in one commit (the book's transactions), each as `cancel`
        would; returns them as committed (those the book does not have left out)."""
        return await self._cancel_retrying(job_ids, f"{len(job_ids)} jobs", reason=reason, by=by)

    async def _cancel_retrying(
        self, job_ids: Sequence[str], what: str, *, reason: str, by: str | None
    ) -> list[status.JobRecord]:
        """`_cancel_all`, decided again after a conflict (the ones committed are skipped
        next time); Unavailable, naming `what`, if that keeps happening."""
        for _ in range(CANCEL_ATTEMPTS):
            try:
                return await self._cancel_all(job_ids, reason=reason, by=by)
            except errors.ConflictError as exc:
                logger.info("cancel of %s raced another write, deciding again: %s", what, exc)
        raise api_errors.Unavailable(
            f"{what} kept changing while being cancelled; retry",
            title="Conflict",
            headers={"Retry-After": "1"},
        )

    async def _cancel_all(
        self, job_ids: Sequence[str], *, reason: str, by: str | None
    ) -> list[status.JobRecord]:
        async with self.book.lock:
            out: list[status.JobRecord] = []
            drafts: list[status.JobRecord] = []
            asking: list[status.JobRecord] = []  # placed: the agent deletes the pods
            for job_id in job_ids:
                draft = self.book.draft(job_id)
                if draft is None:
                    continue
                state = draft.status.state
                if state.terminal or draft.status.cancel_requested:
                    out.append(self.book.get(job_id) or draft)
                    continue
                cluster = self.fleet.clusters.get(draft.status.cluster or "")
                if state in (JobState.QUEUED, JobState.WAITING):
                    text = f"cancelled while {state.value.lower()}"
                    transitions.move(draft, JobState.CANCELLED, reason, text, by=by)
                elif cluster is not None and cluster.lost:
                    text = f"{cluster.name} lost: its agent deletes the pods when it returns"
                    transitions.move(draft, JobState.CANCELLED, reason, text, by=by)
                else:
                    draft.status.cancel_requested = True
                    draft.record(
                        state, "CancelRequested", "waiting for the agent to delete the pods", by=by
                    )
                    asking.append(draft)
                drafts.append(draft)
                out.append(draft)
            try:
                if drafts:
                    await self.book.commit(drafts, fenced=False)
            finally:  # a transaction that failed is not applied: its jobs are not asked
                for draft in asking:
                    if self.book.get(draft.id) is draft:
                        await self.fleet.send_cancel(
                            draft.status.cluster,
                            draft.id,
                            epoch=draft.status.epoch,
                            reason=reason,
                            attempt=transitions.attempt_of(draft),
                        )
            return out


class ForwardedCancels:
    """Cancels committed by another replica, sent by the leader to the job's agent.

    A `book.JobBook` observer: a remote change that sets `cancel_requested` on a job placed on
    a cluster is noted while this replica leads, and `run` (a leader task) sends the Cancel
    of that attempt; a cluster the leader holds lost ends the job Cancelled at once, as a
    cancel on the leader would. A job whose agent is not connected gets its Cancel from the
    hello reconciliation when the agent comes back."""

    def __init__(
        self, jobs: book.JobBook, clusters: fleet.Fleet, *, leading: Callable[[], bool]
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self._leading = leading
        self._pending: dict[str, status.JobRecord] = {}
        self._wake = asyncio.Event()
        self.sent = 0

    def __call__(self, change: book.Change) -> None:
        before, after = change.before, change.after
        if not change.remote or before is None or before.status.cancel_requested:
            return
        if not after.status.cancel_requested or after.status.state.terminal:
            return
        if after.status.cluster and self._leading():
            self._pending[after.id] = after
            self._wake.set()

    async def run(self) -> None:
        """Send the Cancels noted, until cancelled; one failure does not stop the others."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            for record in pending.values():
                try:
                    await self._forward(record)
                except Exception:
                    logger.exception("forwarding the cancel of %s failed", record.id)

    async def _forward(self, record: status.JobRecord) -> None:
        name = record.status.cluster or ""
        cluster = self.fleet.clusters.get(name)
        if cluster is not None and cluster.lost:
            async with self.book.lock:
                draft = self.book.draft(record.id)
                if draft is None or draft.status.state.terminal or draft.status.cluster != name:
                    return
                text = f"{name} lost: its agent deletes the pods when it returns"
                transitions.move(draft, JobState.CANCELLED, "Cancelled", text)
                await self.book.commit([draft])
            return
        if await self.fleet.send_cancel(
            name,
            record.id,
            epoch=record.status.epoch,
            reason="Cancelled",
            attempt=transitions.attempt_of(record),
        ):
            self.sent += 1
