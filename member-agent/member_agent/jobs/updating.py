"""The job updates the agent sends the broker, and the final ones kept until acknowledged.

`handling.JobHandler` hands every state a job reaches to `Updater`: the steps its pods imply,
a final state sent again (a re-sent offer, a cancel of a finished job), a cancel's outcome, the
final state of a job adopted after it finished. A final report (Succeeded, Failed, Cancelled)
gets a `seq` and stays in `pending` until the broker acknowledges it (`acknowledge`), however
long that takes: it is sent again on every session the broker welcomes (`session_started`)
and, on a live session, when no ack came within `resend_seconds` (`resend_overdue`). The broker
applies a report once however often it arrives, so a job never runs again because its report
was lost; `table.JobTable` keeps (and lists in hello) a finished job until acknowledged. A
broker of protocol 1 does not acknowledge: with it a report counts as delivered once written.
Updates that are not final are sent once (hello tells a broker that missed one). The
`job.running` span, from the gang running to its final state, is recorded here, in the job's
trace. No socket here: updates leave through `send` (the session's router).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace

from broker.api import messages, status
from member_agent.jobs import spans, table

# a final report not acknowledged this long after it was written is sent again
RESEND_SECONDS = 10.0


class Send(Protocol):
    def __call__(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None: ...


@dataclass
class Pending:
    """A final report the broker has not acknowledged yet."""

    record: table.TrackedJob
    update: messages.JobUpdate
    written_at: float | None = None  # on the current session; None: to send (again)


class Updater:
    def __init__(
        self, send: Send, *, clock: Callable[[], float], resend_seconds: float = RESEND_SECONDS
    ) -> None:
        self.send = send
        self.clock = clock
        self.resend_seconds = resend_seconds
        self.pending: dict[int, Pending] = {}  # seq -> the report
        self.resent = 0
        self._seq = 0
        self._acked_on_write = False  # the broker of this session does not acknowledge
        self.checkpoints = False  # the broker of this session reads checkpoints (protocol 4)

    # -- what the handler says -------------------------------------------------------------

    def send_state(self, record: table.TrackedJob, state: status.JobState, reason: str) -> None:
        """The job reached `state` (or it is said again): the update, traced."""
        self._trace_running(record, state, reason)
        update = record.update(state, reason)
        if state.terminal:
            self._deliver(record, update)
        else:
            self.send(update)

    def send_final(self, record: table.TrackedJob, *, message: str) -> None:
        """The record's final state, with a message of its own (a cancel's outcome)."""
        update = record.update()
        update.message = message
        self._deliver(record, update)

    def send_checkpoint(self, record: table.TrackedJob) -> None:
        """The job's newest checkpoint, to a broker that reads it (not kept: the next one,
        or the job's record, says it again)."""
        if not self.checkpoints:
            return
        update = record.update()
        update.checkpoint = record.checkpoint
        self.send(update)

    def hold_final(self, record: table.TrackedJob) -> None:
        """The final state of a job found finished at start: sent with the next session."""
        self._keep(record, record.update())

    def send_cancelled(self, cancel: messages.Cancel) -> None:
        """A cancel of an attempt the table does not hold: it is stopped. Not kept: a broker
        that misses it finds the job gone from the next hello, with the same outcome."""
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

    # -- delivery --------------------------------------------------------------------------

    def _keep(self, record: table.TrackedJob, update: messages.JobUpdate) -> int:
        """Keep `update` as the record's final report until acknowledged; its seq. A final
        state said again replaces the report still pending, under the same seq."""
        seq = record.report_seq
        if seq is None or seq not in self.pending:
            self._seq += 1
            seq = self._seq
        record.report_seq = seq
        record.acked_at = None
        update.seq = seq
        self.pending[seq] = Pending(record, update)
        return seq

    def _deliver(self, record: table.TrackedJob, update: messages.JobUpdate) -> None:
        self._send_pending(self._keep(record, update))

    def _send_pending(self, seq: int) -> None:
        entry = self.pending[seq]
        entry.written_at = None

        def written() -> None:
            if self.pending.get(seq) is entry:
                entry.written_at = self.clock()
                if self._acked_on_write:
                    self.acknowledge([seq])

        self.send(entry.update, on_sent=written)

    def acknowledge(self, seqs: Iterable[int]) -> int:
        """The broker has these reports (committed): forget them. Returns how many were
        pending (an ack may repeat one, or name one of an earlier process: ignored)."""
        now = self.clock()
        done = 0
        for seq in seqs:
            entry = self.pending.pop(seq, None)
            if entry is None:
                continue
            entry.record.acked_at = now
            entry.record.report_seq = None
            done += 1
        return done

    def session_started(self, *, acks: bool, checkpoints: bool = False) -> int:
        """A session the broker welcomed, after a hello that listed every finished job not
        acknowledged: their reports are sent again on it (returns how many). A broker that
        does not acknowledge (`acks` False: protocol 1) has them from the hello: delivered.
        `checkpoints`: the broker reads `JobUpdate.checkpoint` (protocol 4)."""
        self._acked_on_write = not acks
        self.checkpoints = checkpoints
        if not acks:
            self.acknowledge(list(self.pending))
            return 0
        for seq in sorted(self.pending):
            self._send_pending(seq)
        return len(self.pending)

    def resend_overdue(self) -> int:
        """Send again the reports written on this session and not acknowledged within
        `resend_seconds` (the broker may have dropped one: a conflict, a restart)."""
        now = self.clock()
        due = [
            seq
            for seq, entry in self.pending.items()
            if entry.written_at is not None and now - entry.written_at >= self.resend_seconds
        ]
        for seq in due:
            self._send_pending(seq)
        self.resent += len(due)
        return len(due)

    @staticmethod
    def _trace_running(record: table.TrackedJob, state: status.JobState, reason: str) -> None:
        """`job.running`: from the gang running to its final state, in the job's trace."""
        if not spans.recording():
            return
        if state == status.JobState.RUNNING and record.running_since_ns is None:
            record.running_since_ns = time.time_ns()
        elif state.terminal and record.running_since_ns is not None:
            span = spans.tracer.start_span(
                "job.running",
                context=spans.context_of(record.traceparent),
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
