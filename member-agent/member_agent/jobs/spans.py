"""The agent's spans of a job's trace (`agent.place`, `agent.bind`, `job.running`), in the
trace the offer carries; none is started when the process records none.

`gpufed agent` installs a provider that samples nothing when it has nowhere to send spans (no
OTLP endpoint and no OTEL_TRACES_SAMPLER: `broker.telemetry.tracing.provider_for`). Its spans
would be dropped, and starting them (the traceparent parsed, a context attached and detached)
is a share of an agent's CPU worth saving; `span` is then a no-op and `recording` false.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.util.types import AttributeValue

tracer = trace.get_tracer("member_agent.jobs")


def recording() -> bool:
    """Whether spans started now are recorded (false under a provider that samples none)."""
    provider = trace.get_tracer_provider()
    return not (isinstance(provider, TracerProvider) and provider.sampler is sampling.ALWAYS_OFF)


def context_of(traceparent: str | None) -> Context:
    """The context a W3C traceparent names (an empty one for none)."""
    return propagate.extract({"traceparent": traceparent or ""})


def span(
    name: str, traceparent: str | None, attributes: Mapping[str, AttributeValue]
) -> AbstractContextManager[object]:
    """A span of the job's trace around a block, made current; nothing when not recording."""
    if not recording():
        return contextlib.nullcontext()
    return tracer.start_as_current_span(
        name, context=context_of(traceparent), attributes=dict(attributes)
    )
