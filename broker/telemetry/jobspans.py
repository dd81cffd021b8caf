"""The broker's spans of a job's trace, written as the job moves (see `tracing`).

Called by `jobs.observing` for each committed transition (and by `jobs.dispatching` and
`jobs.reports` for offers and their answers); the pure planner has no spans. Spans that cover
waiting (queue, dispatch) are written when the wait ends, with their true start times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from opentelemetry import trace

from broker.api import status
from broker.telemetry import tracing

tracer = trace.get_tracer("gpufed.broker")


@dataclass
class _Open:
    span: trace.Span
    traceparent: str


@dataclass
class JobSpans:
    """Open spans and wait reasons of the jobs this broker is moving."""

    dispatching: dict[str, _Open] = field(default_factory=dict)
    waits: dict[str, list[tuple[datetime, tuple[str, ...]]]] = field(default_factory=dict)

    def new_trace(self, *, own: bool = False) -> tuple[str, str | None]:
        """Ids for a new job: its `job` span's traceparent, and the request's (the HTTP
        span). The job's trace is the request's, the request's span its parent; with `own`
        (one of the many jobs a batch or an array makes: a trace each, not thousands of jobs
        in one) the job has a trace of its own, and the request's span is a link of its
        `job` span (`finished`: a parent from another trace cannot be one). Whether the
        trace is recorded is decided here, once (`tracing.decide_sampled`)."""
        current = trace.get_current_span().get_span_context()
        request = parent = None
        if current.is_valid:
            request = tracing.traceparent_of_context(current)
            parent = None if own else current
        trace_id = current.trace_id if parent is not None else tracing.IDS.getrandbits(128) or 1
        flags = "01" if tracing.decide_sampled(trace_id, parent) else "00"
        return f"00-{trace_id:032x}-{tracing.IDS.getrandbits(64) or 1:016x}-{flags}", request

    def waiting(self, job_id: str, reasons: tuple[str, ...], *, now: datetime) -> None:
        if not tracing.records_spans():
            return
        log = self.waits.setdefault(job_id, [])
        if not log or log[-1][1] != reasons:
            log.append((now, reasons))

    def dispatched(
        self,
        record: status.JobRecord,
        *,
        queued_at: datetime,
        now: datetime,
        cycle: trace.Span | None = None,
    ) -> None:
        if not tracing.records_trace(record.traceparent):
            self.waits.pop(record.id, None)
            return  # the offer goes with the job's traceparent (`offer_traceparent`)
        ctx = tracing.context_of(record.traceparent)
        queue = tracer.start_span(
            "job.queue",
            context=ctx,
            start_time=tracing.nanos(queued_at),
            attributes={"gpufed.job": record.id, "gpufed.queue": record.job.spec.queue},
        )
        for moment, reasons in self.waits.pop(record.id, []):
            queue.add_event(
                "waiting",
                timestamp=tracing.nanos(moment),
                attributes={"reasons": list(reasons)[:10]},
            )
        queue.end(end_time=tracing.nanos(now))
        links = [trace.Link(cycle.get_span_context())] if cycle is not None else []
        with tracer.start_as_current_span(
            "job.schedule",
            context=ctx,
            links=links,
            attributes={
                "gpufed.job": record.id,
                "gpufed.cluster": record.status.cluster or "",
                "gpufed.attempt": record.status.attempts,
            },
        ):
            pass
        span = tracer.start_span(
            "job.dispatch",
            context=ctx,
            attributes={
                "gpufed.job": record.id,
                "gpufed.cluster": record.status.cluster or "",
                "gpufed.epoch": record.status.epoch,
            },
        )
        self.dispatching[record.id] = _Open(span, tracing.traceparent_of(span))

    def offer_traceparent(self, record: status.JobRecord) -> str | None:
        opened = self.dispatching.get(record.id)
        return opened.traceparent if opened else record.traceparent

    def answered(self, job_id: str, *, accepted: bool, reasons: list[str] | None = None) -> None:
        opened = self.dispatching.pop(job_id, None)
        if opened is None:
            return
        opened.span.set_attribute("gpufed.accepted", accepted)
        if not accepted:
            opened.span.set_status(trace.StatusCode.ERROR, "; ".join(reasons or [])[:500])
        opened.span.end()

    def finished(self, record: status.JobRecord, *, now: datetime) -> None:
        """Write the `job` span, submit to final state, with the ids chosen at submit."""
        self.answered(record.id, accepted=False, reasons=["job ended while offered"])
        self.waits.pop(record.id, None)
        if not record.traceparent or not tracing.records_trace(record.traceparent):
            return
        trace_id, span_id = tracing.ids_of(record.traceparent)
        request = record.trace_parent
        mine = request is not None and tracing.ids_of(request)[0] == trace_id
        links = [] if request is None or mine else [trace.Link(tracing.span_context_of(request))]
        with tracing.preset_ids(trace_id, span_id):
            span = tracer.start_span(
                "job",
                context=tracing.context_of(request if mine else None),
                links=links,
                start_time=tracing.nanos(record.created),
                attributes={
                    "gpufed.job": record.id,
                    "gpufed.tenant": record.tenant,
                    "gpufed.queue": record.job.spec.queue,
                    "gpufed.state": record.status.state.value,
                    "gpufed.cluster": record.status.cluster or "",
                    "gpufed.attempts": record.status.attempts,
                    "gpufed.gpus": sum(len(p.gpus) for p in record.status.pods),
                },
            )
        for event in record.status.events:
            span.add_event(
                event.state.value,
                timestamp=tracing.nanos(event.time),
                attributes={"reason": event.reason, "message": event.message[:200]},
            )
        if record.status.state == status.JobState.FAILED:
            span.set_status(trace.StatusCode.ERROR, record.status.events[-1].reason)
        span.end(end_time=tracing.nanos(now))
