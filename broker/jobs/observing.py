"""What a committed change of a job tells the outside: one log line per transition, the
job's spans, the job metrics. A `book.JobBook` observer; it decides nothing.

With several replicas only the leader tells (`active`): it applies every change, its own and
those followers commit (a cancel), so each transition is logged, counted and traced once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from broker.api.status import JobState
from broker.jobs import book
from broker.telemetry import jobspans, metrics

logger = logging.getLogger(__name__)


class JobTelemetry:
    def __init__(
        self,
        spans: jobspans.JobSpans,
        meters: metrics.BrokerMetrics,
        *,
        active: Callable[[], bool] | None = None,
    ) -> None:
        self.spans = spans
        self.meters = meters
        self._active = active

    def __call__(self, change: book.Change) -> None:
        if change.before is None:  # a new job, or one loaded at start
            return
        if self._active is not None and not self._active():
            return  # a follower: the leader tells it
        record = change.after
        previous = change.before.status.events
        queued_at = previous[-1].time if previous else record.created
        state = change.before.status.state
        for event in change.new_events():
            self._moved(change, state, event.state, event.reason, queued_at=queued_at)
            if event.state != state:
                state = event.state
            queued_at = event.time

    def _moved(
        self,
        change: book.Change,
        before: JobState,
        state: JobState,
        reason: str,
        *,
        queued_at: datetime,
    ) -> None:
        record = change.after
        logger.info(
            "job %s: %s -> %s (%s)",
            record.id,
            before.value,
            state.value,
            reason,
            extra={
                "job_id": record.id,
                "cluster": record.status.cluster or "",
                "trace_id": record.trace_id or "",
                "state": state.value,
            },
        )
        events = record.status.events
        now = events[-1].time
        if state == JobState.DISPATCHED and before != JobState.DISPATCHED:
            self.spans.dispatched(record, queued_at=queued_at, now=now)
            dispatched = record.event_time(JobState.DISPATCHED)
            if dispatched is not None and record.status.attempts <= 1:
                self.meters.submit_to_dispatch.observe(
                    (dispatched - record.created).total_seconds()
                )
        elif state.terminal and not before.terminal:
            self.spans.finished(record, now=now)
            queue = self.meters.queue_label(record.job.spec.queue)
            self.meters.jobs_finished.labels(queue=queue, state=state.value).inc()
        if state == JobState.RUNNING and before != JobState.RUNNING:
            started = record.event_time(JobState.QUEUED) or record.created
            self.meters.submit_to_running.observe((now - started).total_seconds())
