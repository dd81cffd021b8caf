"""The agent's job spans (`jobs.spans`): started under a provider that records, not at all
under one that samples none (the agent with nowhere to send spans)."""

from __future__ import annotations

import contextlib

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from member_agent.jobs import spans

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_no_span_is_started_when_none_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = TracerProvider(sampler=sampling.ALWAYS_OFF)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: quiet)
    assert not spans.recording()
    assert isinstance(spans.span("agent.place", PARENT, {"job_id": "j"}), contextlib.nullcontext)


def test_a_recording_provider_gets_the_span_in_the_offers_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    monkeypatch.setattr(spans, "tracer", provider.get_tracer("member_agent.jobs"))
    assert spans.recording()
    with spans.span("agent.place", PARENT, {"job_id": "j"}):
        pass
    (done,) = exporter.get_finished_spans()
    assert done.name == "agent.place" and done.attributes == {"job_id": "j"}
    assert f"{done.context.trace_id:032x}" == PARENT.split("-")[1]
