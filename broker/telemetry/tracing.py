"""Tracing: one trace per job, from submit to its final state, across broker and agent.

Setup reads the standard `OTEL_*` variables: spans are exported over OTLP (http/protobuf by
default, grpc when `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL=grpc`) only when an endpoint is set;
the sampler, headers and timeouts are the SDK's own `OTEL_*` settings. With no endpoint (and
no `OTEL_TRACES_SAMPLER`) nothing is recorded: spans still carry ids, so traceparents, trace
ids in the API and in log lines are as they would be, but a span costs no attributes or events
(`records_spans()` false: the job spans are not even started, since under load spans nobody
receives take a noticeable share of a broker's CPU).

A job's trace is sampled once, when it is submitted (`decide_sampled`): the decision is the
sampled flag of its traceparent, which the broker's later spans of the job follow
(`records_trace`), and the agent's under a `parentbased_*` sampler; a trace is exported whole
or not at all, and a job not sampled keeps its ids.

A job's trace: the HTTP request span → `job` (submit to final state) → `job.submit`,
`job.queue` (with the reasons it waited as events), `job.schedule`, `job.dispatch` → (agent)
`agent.place`, `agent.bind`, `job.running`. The `job` span's ids are chosen at submit and
kept with the job, so spans minutes apart — in other processes, after restarts — join it; the
span itself is written when the job ends, with its true start time.
"""

from __future__ import annotations

import contextvars
import os
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PRESET: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "gpufed_preset_ids", default=None
)
PROPAGATOR = TraceContextTextMapPropagator()


# trace and span ids, the SDK's (`PresetIdGenerator`) and a job's (`jobspans`): drawn from a
# generator seeded once from the OS, as the SDK's own `RandomIdGenerator` draws from `random`
IDS = random.Random(os.urandom(32))


class PresetIdGenerator(IdGenerator):
    """Random ids, except inside `preset_ids(...)`, where the next span takes the given ones.

    Drawn from a generator seeded once from the OS, as the SDK's own `RandomIdGenerator`
    draws from `random`: ids must not repeat, not be secret, and a system call per id (five
    spans and more a job) cost more than the rest of choosing it."""

    def __init__(self) -> None:
        self._random = IDS

    def generate_span_id(self) -> int:
        preset = _PRESET.get()
        if preset is not None:
            return preset[1]
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        preset = _PRESET.get()
        if preset is not None:
            return preset[0]
        return self._random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


@contextmanager
def preset_ids(trace_id: int, span_id: int) -> Iterator[None]:
    token = _PRESET.set((trace_id, span_id))
    try:
        yield
    finally:
        _PRESET.reset(token)


def _exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint or environ.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return None
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


def setup(
    service: str, *, cluster: str | None = None, environ: Mapping[str, str] | None = None
) -> TracerProvider:
    """Install the global tracer provider of this process."""
    provider = provider_for(service, cluster=cluster, environ=environ)
    trace.set_tracer_provider(provider)
    return provider


def provider_for(
    service: str, *, cluster: str | None = None, environ: Mapping[str, str] | None = None
) -> TracerProvider:
    """The tracer provider `setup` installs, from `environ` (default: the process's)."""
    env = os.environ if environ is None else environ
    attributes: dict[str, str] = {"service.name": env.get("OTEL_SERVICE_NAME", service)}
    if cluster:
        attributes["gpufed.cluster"] = cluster
    exporter = _exporter(env)
    quiet = exporter is None and not env.get("OTEL_TRACES_SAMPLER")
    provider = TracerProvider(
        sampler=sampling.ALWAYS_OFF if quiet else None,
        resource=Resource.create(attributes),
        id_generator=PresetIdGenerator(),
    )
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def records_spans(provider: trace.TracerProvider | None = None) -> bool:
    """Whether spans started now are recorded (false when `setup` found nowhere to send them),
    by the process's provider or `provider`."""
    provider = provider or trace.get_tracer_provider()
    return not (isinstance(provider, TracerProvider) and provider.sampler is sampling.ALWAYS_OFF)


def decide_sampled(trace_id: int, parent: trace.SpanContext | None = None) -> bool:
    """Whether a new job's trace is recorded: what the process's sampler decides for its `job`
    span, under `parent` (the request's span) or as a trace of its own. The decision goes in
    the job's traceparent (its sampled flag). True when this process records no spans: the
    flag then leaves the choice to whoever receives the traceparent, as it always has."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider) or provider.sampler is sampling.ALWAYS_OFF:
        return True
    context = otel_context.Context()  # a trace of its own: no parent, not the current span
    if parent is not None:
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent), context)
    decision = provider.sampler.should_sample(context, trace_id, "job").decision
    return decision is sampling.Decision.RECORD_AND_SAMPLE


def records_trace(traceparent: str | None) -> bool:
    """Whether spans of the job whose traceparent this is are recorded here: this process
    records spans (`records_spans`) and the trace was sampled at submit (`decide_sampled`)."""
    if not traceparent or not records_spans():
        return False
    flags = traceparent.split("-")[3]
    return bool(int(flags, 16) & trace.TraceFlags.SAMPLED)


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def context_of(traceparent: str | None) -> otel_context.Context:
    """The context a W3C traceparent names (an empty context if none)."""
    if not traceparent:
        return otel_context.Context()
    return PROPAGATOR.extract({"traceparent": traceparent})


def span_context_of(traceparent: str) -> trace.SpanContext:
    """The span a W3C traceparent names (invalid if it names none)."""
    return trace.get_current_span(context_of(traceparent)).get_span_context()


def traceparent_of(span: trace.Span) -> str:
    return traceparent_of_context(span.get_span_context())


def traceparent_of_context(ctx: trace.SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def ids_of(traceparent: str) -> tuple[int, int]:
    parts = traceparent.split("-")
    return int(parts[1], 16), int(parts[2], 16)


def nanos(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000_000)
