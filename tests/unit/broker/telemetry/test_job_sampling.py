"""A job's trace is sampled once, at submit, by the process's sampler (the standard
`OTEL_TRACES_SAMPLER`): the decision is its traceparent's flag, and the job's later spans
follow it, so a trace is exported whole or not at all."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from broker.api import status
from broker.api.status import JobState
from broker.telemetry import jobspans, tracing
from tests.builders import make_job

CALLER_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
JOB_SPANS = {"job.queue", "job.schedule", "job.dispatch", "job"}
NONE = sampling.ParentBased(sampling.TraceIdRatioBased(0))  # parentbased_traceidratio, 0
ALL = sampling.ParentBased(sampling.TraceIdRatioBased(1))


def run_a_job(spans: jobspans.JobSpans, *, own: bool) -> status.JobRecord:
    """A job through the broker's spans: submitted (in the current span, the request's),
    dispatched, its offer accepted, succeeded."""
    traceparent, request = spans.new_trace(own=own)
    record = status.JobRecord(
        id="j-1",
        tenant="team-a",
        job=make_job("sampled").build(),
        traceparent=traceparent,
        trace_parent=request,
        trace_id=traceparent.split("-")[1],
    )
    record.record(JobState.QUEUED, "Submitted")
    queued = record.status.events[-1].time
    record.status.cluster, record.status.epoch, record.status.attempts = "h100", 1, 1
    record.record(JobState.DISPATCHED, "Dispatched", "to h100")
    spans.dispatched(record, queued_at=queued, now=queued + timedelta(seconds=1))
    spans.answered(record.id, accepted=True)
    record.record(JobState.SUCCEEDED, "Succeeded")
    spans.finished(record, now=queued + timedelta(seconds=2))
    return record


@pytest.mark.parametrize(
    ("sampler", "caller", "own", "flag", "exported"),
    [
        pytest.param(
            sampling.ALWAYS_OFF, None, False, "01", set(), id="nothing configured: none recorded"
        ),
        pytest.param(NONE, None, False, "00", set(), id="ratio 0: not sampled, no span"),
        pytest.param(ALL, None, False, "01", JOB_SPANS, id="ratio 1: sampled, every span"),
        pytest.param(
            NONE, CALLER_SAMPLED, False, "01", JOB_SPANS, id="in a request its caller sampled"
        ),
        pytest.param(
            NONE, CALLER_SAMPLED, True, "00", set(), id="a batch's job: its own trace, decided"
        ),
        pytest.param(
            sampling.TraceIdRatioBased(0),
            CALLER_SAMPLED,
            False,
            "00",
            set(),
            id="a sampler that heeds no parent: its decision, whatever the request's",
        ),
    ],
)
def test_a_jobs_trace_is_sampled_at_submit_and_its_spans_follow(
    monkeypatch: pytest.MonkeyPatch,
    *,
    sampler: sampling.Sampler,
    caller: str | None,
    own: bool,
    flag: str,
    exported: set[str],
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler, id_generator=tracing.PresetIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    monkeypatch.setattr(jobspans, "tracer", provider.get_tracer("gpufed.broker"))
    request: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if caller is not None:  # the HTTP request's span, as the aiohttp instrumentation starts it
        request = provider.get_tracer("aiohttp").start_as_current_span(
            "POST /v1/jobs", context=tracing.context_of(caller)
        )
    spans = jobspans.JobSpans()

    with request:
        record = run_a_job(spans, own=own)

    assert record.traceparent is not None and record.traceparent.endswith(f"-{flag}")
    assert tracing.records_trace(record.traceparent) == bool(exported)
    names = {s.name for s in exporter.get_finished_spans()} - {"POST /v1/jobs"}
    assert names == exported
    assert not spans.dispatching and not spans.waits
    provider.shutdown()
