"""Logging for gpufed processes: JSON lines on stderr, each with the context it was logged in.

A line carries `trace_id` and `span_id` of the current OpenTelemetry span when there is one
(so a log line leads to its trace in Tempo), the fields bound with `bind(job_id=..., cluster=...)`
(kept in the `CONTEXT` contextvar: they follow the asyncio task and the tasks it starts), and
the fields given to one call with `extra=`:

    with logs.bind(cluster=name):
        logger.info("offer sent", extra={"job_id": job_id})

A call's `extra=` wins over bound fields, and bound fields over the span's ids.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from opentelemetry import trace

CONTEXT: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("gpufed_log_context")

# attributes every LogRecord has: anything else on a record came from `extra=`
_BLANK = logging.LogRecord("", logging.INFO, "", 0, "", None, None)
_RECORD_ATTRIBUTES = frozenset({*vars(_BLANK), "message", "asctime", "taskName"})


@contextmanager
def bind(**fields: object) -> Iterator[None]:
    """Add `fields` to every line logged inside the block, in this task and those it starts."""
    token = CONTEXT.set({**CONTEXT.get({}), **{key: str(value) for key, value in fields.items()}})
    try:
        yield
    finally:
        CONTEXT.reset(token)


def read_context(record: logging.LogRecord) -> dict[str, object]:
    """The context fields of one line: the span's ids, then bound fields, then `extra=`."""
    fields: dict[str, object] = {}
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        fields["trace_id"] = format(span.trace_id, "032x")
        fields["span_id"] = format(span.span_id, "016x")
    fields.update(CONTEXT.get({}))
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
            fields[key] = value
    return fields


_ENCODER = json.JSONEncoder(default=str)  # one, not one per line as `json.dumps(default=)`


class _Stamps:
    """A line's time as `datetime.isoformat(timespec="milliseconds")` writes it in UTC, the
    date and time of day formatted once a second, not once a line."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, created: float) -> str:
        second = math.floor(created)
        micros = round((created - second) * 1_000_000)  # as `datetime.fromtimestamp` rounds
        if micros >= 1_000_000:
            second, micros = second + 1, micros - 1_000_000
        if second != self._second:
            moment = datetime.fromtimestamp(second, UTC)
            self._second, self._prefix = second, moment.strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._prefix}.{micros // 1000:03d}+00:00"


class JsonFormatter(logging.Formatter):
    def __init__(self, *, service: str) -> None:
        super().__init__()
        self.service = service
        self._stamp = _Stamps()

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": self._stamp(record.created),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(read_context(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(line)


def setup(*, service: str, level: str = "INFO", json_lines: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter(service=service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # no line of ours shows where it was logged from: skip the stack walk each call makes for
    # it (the logging HOWTO's "Optimization"; a tenth of the cost of a job's transition line)
    logging._srcfile = None
    # nor its thread or process: each record would look them up. With the stamps, a transition
    # line costs 17-19 us here instead of 22 (medians of 7 x 20,000 calls, two pairs)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
