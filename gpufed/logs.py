"""Logging for gpufed processes: JSON lines on stderr, each with the context it was logged in.

A line carries `trace_id` and `span_id` of the current OpenTelemetry span when there is one
(so a log line leads to its trace in Tempo), the fields bound with `bind(job_id=..., cluster=...)`
(kept in `kits.logcontext`'s contextvar: they follow the asyncio task and the tasks it starts), and
the fields given to one call with `extra=`:

    with logs.bind(cluster=name):
        logger.info("offer sent", extra={"job_id": job_id})

A call's `extra=` wins over bound fields, and bound fields over the span's ids.

Lines logged from the event loop are written once per turn of the loop (`TurnHandler`), a
write of all of them rather than one system call each: a busy broker logs a line per job
transition, thousands a second. A warning or worse, and a line from another thread, is
written at once, after those before it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import json.encoder
import logging
import math
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

from kits import logcontext

# the fields bound for a block: kept in `kits.logcontext`, which the broker and agent import
bind = logcontext.bind

# attributes every LogRecord has: anything else on a record came from `extra=`
_BLANK = logging.LogRecord("", logging.INFO, "", 0, "", None, None)
_RECORD_ATTRIBUTES = frozenset({*vars(_BLANK), "message", "asctime", "taskName"})


def read_context(record: logging.LogRecord) -> dict[str, object]:
    """The context fields of one line: the span's ids, then bound fields, then `extra=`."""
    fields: dict[str, object] = {}
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        fields["trace_id"] = format(span.trace_id, "032x")
        fields["span_id"] = format(span.span_id, "016x")
    fields.update(logcontext.bound())
    for key, value in vars(record).items():
        if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
            fields[key] = value
    return fields


# a line's own keys: a context field of the same name takes its place (`JsonFormatter.format`)
_LINE_KEYS = frozenset({"time", "level", "service", "logger", "message", "exception"})
_ENCODER = json.JSONEncoder(default=str)  # one, not one per line as `json.dumps(default=)`
_quote = json.encoder.encode_basestring_ascii  # a str as `_ENCODER` writes it


def _encoder() -> Callable[[dict[str, object]], str]:
    """`_ENCODER.encode` for a dict, without what that does on each call: make the C encoder
    (`json.encoder.c_make_encoder`, as `JSONEncoder.iterencode` makes it) and its closure
    anew. Made once here, without the table of values being written that finds a value
    holding itself: one shared by threads would see another's; a value that does hold itself
    runs out of depth, and `_ENCODER` then refuses it as it always has."""
    make: Callable[..., Callable[[object, int], Sequence[str]]] | None
    make = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed
    if make is None:  # no C accelerator
        return _ENCODER.encode
    e = _ENCODER
    encode = make(
        None, e.default, _quote, None, e.key_separator, e.item_separator, False, False, True
    )

    def encoded(fields: dict[str, object]) -> str:
        try:
            return "".join(encode(fields, 0))
        except RecursionError:
            return _ENCODER.encode(fields)

    return encoded


_encode = _encoder()


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
        self._head = functools.lru_cache(maxsize=1024)(self._head_of)

    def format(self, record: logging.LogRecord) -> str:
        """A JSON object: time, level, service, logger, message, the context fields (a field
        named as one of these takes its place), the exception's text. The same text as
        `json.dumps(line, default=str)` of that object, written in parts: the line's own keys
        and the context's apart, and the head of the line kept for each logger and level."""
        fields = read_context(record)
        if not _LINE_KEYS.isdisjoint(fields):
            return self._format_whole(record, fields)
        head = self._head(record.name, record.levelname)
        text = f'{{"time": "{self._stamp(record.created)}"{head}{_quote(record.getMessage())}'
        if fields:
            text = f"{text}, {_encode(fields)[1:-1]}"
        if record.exc_info:
            text = f'{text}, "exception": {_quote(self.formatException(record.exc_info))}'
        return text + "}"

    def _format_whole(self, record: logging.LogRecord, fields: dict[str, object]) -> str:
        line: dict[str, object] = {
            "time": self._stamp(record.created),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _encode(line)

    def _head_of(self, logger: str, level: str) -> str:
        """The line from after its time to its message: the same for each logger and level."""
        head = _encode({"level": level.lower(), "service": self.service, "logger": logger})
        return f', {head[1:-1]}, "message": '


class TurnHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes the lines logged in one turn of the event loop together,
    at the end of that turn (`loop.call_soon`); at once, after any held, a line at
    `immediate_level` or worse, or logged where no loop runs (another thread, before start).
    A line is held at most until the loop next turns: a process killed outright loses the
    lines of that turn only."""

    def __init__(self, stream: Any = None, *, immediate_level: int = logging.WARNING) -> None:
        super().__init__(stream)
        self.immediate_level = immediate_level
        self._held: list[str] = []
        self._due = False  # a write of the held lines is scheduled on the loop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._held.append(self.format(record) + self.terminator)
            if record.levelno >= self.immediate_level or not self._schedule():
                self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def _schedule(self) -> bool:
        """Whether the line may wait for the end of the loop's turn (a write scheduled)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if not self._due:
            loop.call_soon(self.flush)
            self._due = True
        return True

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            self._due = False
            text, self._held = "".join(self._held), []
            try:
                if text:
                    self.stream.write(text)
                if self.stream and hasattr(self.stream, "flush"):
                    self.stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nowhere to write
                pass


def skip_record_lookups() -> None:
    """Records without what no line of ours shows, for every logger of the process: where it
    was logged from (the stack walk each call makes for it: the logging HOWTO's
    "Optimization"), nor its thread or process (looked up for each record, on every job's
    transitions)."""
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


def setup(*, service: str, level: str = "INFO", json_lines: bool = True) -> None:
    handler = TurnHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter(service=service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    skip_record_lookups()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
