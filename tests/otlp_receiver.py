"""An in-process OTLP/HTTP trace receiver for tests: parses the real protobuf export requests.

No collector, Tempo or Jaeger can be installed here, so tests point `OTEL_EXPORTER_OTLP_ENDPOINT`
at this server and read back exactly what the processes exported.
"""

from __future__ import annotations

import asyncio
import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    resource: dict[str, Any]
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    links: tuple[str, ...]  # linked span ids


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attrs(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # False: keep each request's body, parsed when `count_spans` asks (a benchmark's
    # receiver, spending little of the CPU it measures)
    parse: bool = True
    bodies: list[bytes] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.requests += 1
        if self.parse:
            self._parse(body)
        else:
            self.bodies.append(body)
        self.arrived.set()
        response = trace_service_pb2.ExportTraceServiceResponse()
        return web.Response(
            body=response.SerializeToString(), content_type="application/x-protobuf"
        )

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _parse(self, body: bytes) -> None:
        export = trace_service_pb2.ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            resource = _attrs(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes=_attrs(span.attributes),
                            events=tuple(e.name for e in span.events),
                            links=tuple(link.span_id.hex() for link in span.links),
                        )
                    )

    def count_spans(self) -> int:
        """Spans received so far, the kept requests parsed now (`parse` false)."""
        for body in self.bodies:
            self._parse(body)
        self.bodies.clear()
        return len(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]
