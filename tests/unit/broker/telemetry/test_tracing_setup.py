"""What `tracing.setup` installs: with nowhere to send spans, spans that carry ids and record
nothing; with an OTLP endpoint (or a sampler asked for), spans that record."""

from __future__ import annotations

from broker.telemetry import tracing


def test_with_no_endpoint_spans_keep_their_ids_and_record_nothing() -> None:
    provider = tracing.provider_for("gpufed-broker", environ={})
    assert not tracing.records_spans(provider)
    span = provider.get_tracer("t").start_span("job.queue", attributes={"gpufed.job": "j"})
    context = span.get_span_context()
    assert context.is_valid and not span.is_recording()
    with tracing.preset_ids(0xABC, 0xDEF):
        preset = provider.get_tracer("t").start_span("job").get_span_context()
    assert (preset.trace_id, preset.span_id) == (0xABC, 0xDEF)  # a job's ids, as chosen
    provider.shutdown()


def test_an_endpoint_or_a_sampler_records_spans() -> None:
    for environ in (
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        {"OTEL_TRACES_SAMPLER": "always_on"},
    ):
        provider = tracing.provider_for("gpufed-broker", environ=environ)
        assert tracing.records_spans(provider), environ
        span = provider.get_tracer("t").start_span("job.queue")
        assert span.is_recording()  # not ended: nothing to send to the unreachable endpoint
        provider.shutdown()


def test_the_exporter_none_setting_is_nowhere_to_send() -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "none"}
    assert not tracing.records_spans(tracing.provider_for("gpufed-agent", environ=environ))
