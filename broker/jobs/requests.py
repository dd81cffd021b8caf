"""What users ask of their jobs: submit and cancel. Called by `http/jobs.py` via `service`.

A submit is stored as Queued (group-committed with the submits arriving with it) before it
is answered; a cancel is committed before the agent is asked to delete the pods, and the job
ends Cancelled when the agent reports them gone.
"""

from __future__ import annotations

from broker.api import status
from broker.api.status import JobState
from broker.jobs import book, fleet, transitions
from broker.telemetry import metrics


class Requests:
    def __init__(
        self, jobs: book.JobBook, clusters: fleet.Fleet, *, meters: metrics.BrokerMetrics
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.meters = meters

    async def submit(self, record: status.JobRecord) -> status.JobRecord:
        """Store a new job; with its idempotency key used already, the job stored then."""
        record.record(JobState.QUEUED, "Submitted", "accepted by the broker")
        stored = await self.book.create(record)
        if stored is record:
            self.meters.jobs_submitted.labels(queue=record.job.spec.queue).inc()
        return stored

    async def cancel(self, job_id: str, *, reason: str = "Cancelled") -> status.JobRecord | None:
        """Cancel a job; returns it as committed (None if the book does not have it)."""
        async with self.book.lock:
            draft = self.book.draft(job_id)
            if draft is None:
                return None
            state = draft.status.state
            if state.terminal or draft.status.cancel_requested:
                return self.book.get(job_id)
            if state == JobState.QUEUED:
                transitions.move(draft, JobState.CANCELLED, reason, "cancelled while queued")
                await self.book.commit([draft])
                return draft
            draft.status.cancel_requested = True
            draft.record(state, "CancelRequested", "waiting for the agent to delete the pods")
            await self.book.commit([draft])
            await self.fleet.send_cancel(
                draft.status.cluster,
                draft.id,
                epoch=draft.status.epoch,
                reason=reason,
                attempt=transitions.attempt_of(draft),
            )
            return draft
