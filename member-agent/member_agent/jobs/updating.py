"""The job updates the agent sends the broker, and when a final state counts as reported.

`handling.JobHandler` hands every state a job reaches to `Updater`: the steps its pods imply,
a final state sent again (a re-sent offer, a cancel of a finished job), a cancel's outcome.
An update of a final state is marked reported (`TrackedJob.reported_at`) once it was written
on a live session; `table.JobTable` keeps and relists records by that mark. The `job.running`
span, from the gang running to its final state, is recorded here, in the job's trace. No
socket here: updates leave through `send` (the session's router).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from opentelemetry import propagate, trace

from broker.api import messages, status
from member_agent.jobs import table

tracer = trace.get_tracer("member_agent.jobs")


class Send(Protocol):
    def __call__(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None: ...


class Updater:
    def __init__(self, send: Send, *, clock: Callable[[], float]) -> None:
        self.send = send
        self.clock = clock

    def send_state(self, record: table.TrackedJob, state: status.JobState, reason: str) -> None:
        """The job reached `state` (or it is said again): the update, traced."""
        self._trace_running(record, state, reason)
        update = record.update(state, reason)
        self.send(update, on_sent=self.reported(record) if state.terminal else None)

    def send_final(self, record: table.TrackedJob, *, message: str) -> None:
        """The record's final state, with a message of its own (a cancel's outcome)."""
        update = record.update()
        update.message = message
        self.send(update, on_sent=self.reported(record))

    def send_cancelled(self, cancel: messages.Cancel) -> None:
        """A cancel of an attempt the table does not hold: it is stopped."""
        self.send(
            messages.JobUpdate(
                job_id=cancel.job_id,
                epoch=cancel.epoch,
                state=status.JobState.CANCELLED,
                reason=cancel.reason,
                traceparent=cancel.traceparent,
                attempt=cancel.attempt,
            )
        )

    def reported(self, record: table.TrackedJob) -> Callable[[], None]:
        """What to call once the record's final state went out on a live session."""

        def mark() -> None:
            record.reported_at = self.clock()

        return mark

    @staticmethod
    def _trace_running(record: table.TrackedJob, state: status.JobState, reason: str) -> None:
        """`job.running`: from the gang running to its final state, in the job's trace."""
        if state == status.JobState.RUNNING and record.running_since_ns is None:
            record.running_since_ns = time.time_ns()
        elif state.terminal and record.running_since_ns is not None:
            span = tracer.start_span(
                "job.running",
                context=propagate.extract({"traceparent": record.traceparent or ""}),
                start_time=record.running_since_ns,
                attributes={
                    "gpufed.job": record.job_id,
                    "gpufed.state": state.value,
                    "gpufed.reason": reason,
                    "gpufed.pods": len(record.pods),
                },
            )
            if state == status.JobState.FAILED:
                span.set_status(trace.StatusCode.ERROR, reason)
            span.end()
            record.running_since_ns = None
