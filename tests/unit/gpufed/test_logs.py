"""Each JSON log line carries the trace, job and cluster it was logged for."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import sys
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from gpufed import logs

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0x00F067AA0BA902B7


@contextlib.contextmanager
def attached(name: str, handler: logging.Handler) -> Iterator[logging.Logger]:
    """Logger `name` at INFO, writing through `handler` only, for the block."""
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter(service="gpufed-test"))
    with attached("gpufed.test_logs", handler) as logger:
        yield logger, out


def read_lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def in_span() -> contextlib.AbstractContextManager[object]:
    context = trace.SpanContext(
        TRACE_ID, SPAN_ID, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)
    )
    return trace.use_span(trace.NonRecordingSpan(context))


@pytest.mark.parametrize(
    ("span", "bound", "extra", "expected"),
    [
        pytest.param(False, {}, {}, {}, id="no span, nothing bound: no context fields"),
        pytest.param(
            True,
            {},
            {},
            {"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "00f067aa0ba902b7"},
            id="inside a span: its trace and span ids",
        ),
        pytest.param(
            False,
            {"job_id": "j-1", "cluster": "h100"},
            {},
            {"job_id": "j-1", "cluster": "h100"},
            id="bound through the CONTEXT contextvar",
        ),
        pytest.param(
            False,
            {},
            {"job_id": "j-2", "cluster": "a100"},
            {"job_id": "j-2", "cluster": "a100"},
            id="given to one call with extra=",
        ),
        pytest.param(
            True,
            {"job_id": "j-1", "cluster": "h100"},
            {"job_id": "j-2"},
            {
                "trace_id": "0af7651916cd43dd8448eb211c80319c",
                "span_id": "00f067aa0ba902b7",
                "job_id": "j-2",
                "cluster": "h100",
            },
            id="extra= wins over bound fields, which add to the span's ids",
        ),
        pytest.param(
            True,
            {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"},
            {},
            {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7"},
            id="a job's own trace id bound over the current span's",
        ),
    ],
)
def test_a_line_carries_the_span_and_the_fields_it_was_logged_with(
    lines: tuple[logging.Logger, io.StringIO],
    span: bool,
    bound: dict[str, str],
    extra: dict[str, str],
    expected: dict[str, str],
) -> None:
    logger, out = lines
    with in_span() if span else contextlib.nullcontext(), logs.bind(**bound):
        logger.info("offer %s sent", "o-1", extra=extra)

    [line] = read_lines(out)
    context = {k: v for k, v in line.items() if k in {"trace_id", "span_id", "job_id", "cluster"}}
    assert context == expected
    assert line["message"] == "offer o-1 sent"
    assert line["service"] == "gpufed-test"
    assert line["level"] == "info"


def test_a_recording_span_of_the_sdk_gives_its_ids(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = lines
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("job.dispatch") as span:
        logger.info("dispatching")
    logger.info("after the span")

    inside, after = read_lines(out)
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")
    assert "trace_id" not in after


async def test_bound_fields_follow_tasks_started_inside_and_end_with_the_block(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = lines

    async def report() -> None:
        await asyncio.sleep(0)
        logger.info("from a task")

    with logs.bind(cluster="inference", cycle=7):
        task = asyncio.create_task(report())
    await task
    logger.info("outside")

    from_task, outside = read_lines(out)
    assert (from_task["cluster"], from_task["cycle"]) == ("inference", "7")
    assert "cluster" not in outside and "cycle" not in outside


def test_an_exception_is_logged_with_its_context(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = lines
    with logs.bind(job_id="j-9"):
        try:
            raise RuntimeError("store down")
        except RuntimeError:
            logger.exception("commit failed")

    [line] = read_lines(out)
    assert line["job_id"] == "j-9"
    assert line["level"] == "error"
    assert "RuntimeError: store down" in line["exception"]


@pytest.mark.parametrize(
    "created",
    [0.0, 1764786000.0, 1764786000.0004994, 1764786000.9995, 1764786000.9999996, 1764786059.123456],
)
def test_a_lines_time_is_written_as_isoformat_writes_it(created: float) -> None:
    stamp = logs._Stamps()
    stamp(created - 1.5)  # another second first: the cached one is replaced
    expected = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    assert stamp(created) == expected
    assert stamp(created) == expected  # and again, from the cache


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


@pytest.fixture
def turns() -> Iterator[tuple[logging.Logger, Writes]]:
    out = Writes()
    handler = logs.TurnHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with attached("gpufed.test_logs.turns", handler) as logger:
        yield logger, out


async def test_lines_of_one_turn_of_the_loop_are_written_together_at_its_end(
    turns: tuple[logging.Logger, Writes],
) -> None:
    logger, out = turns
    for n in range(3):
        logger.info("line %d", n)
    assert out.writes == []  # held until the turn ends
    await asyncio.sleep(0)
    assert out.writes == ["line 0\nline 1\nline 2\n"]
    logger.info("line 3")
    await asyncio.sleep(0)
    assert out.getvalue().splitlines() == [f"line {n}" for n in range(4)]


async def test_a_warning_is_written_at_once_after_the_lines_before_it(
    turns: tuple[logging.Logger, Writes],
) -> None:
    logger, out = turns
    logger.info("before")
    logger.warning("the warning")
    assert out.getvalue().splitlines() == ["before", "the warning"]  # no turn needed
    await asyncio.sleep(0)
    assert out.getvalue().splitlines() == ["before", "the warning"]  # nothing twice


async def test_a_line_from_another_thread_is_written_at_once_in_order(
    turns: tuple[logging.Logger, Writes],
) -> None:
    logger, out = turns
    logger.info("from the loop")
    await asyncio.to_thread(logger.info, "from a thread")  # the loop turns while it waits
    logger.info("the loop again")

    def log_and_read() -> str:
        logger.info("thread 2")
        return out.getvalue()  # written at once: no turn of the loop between

    assert (await asyncio.to_thread(log_and_read)).splitlines() == [
        "from the loop",
        "from a thread",
        "the loop again",
        "thread 2",
    ]


async def test_lines_held_when_the_process_exits_are_written(
    turns: tuple[logging.Logger, Writes],
) -> None:
    logger, out = turns
    logger.info("the last line")
    assert out.writes == []  # held: the turn has not ended
    logging.shutdown([lambda: logger.handlers[0]])  # what the atexit hook does, first
    assert out.getvalue().splitlines() == ["the last line"]
    await asyncio.sleep(0)  # the turn's own write finds nothing more
    assert out.getvalue().splitlines() == ["the last line"]


class Stamped(logging.Filter):
    """Gives each record the same moment, so that a whole line can be compared."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.created = 1764786000.25
        return True


@pytest.fixture
def stamped() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter(service="gpufed-test"))
    handler.addFilter(Stamped())
    with attached("gpufed.test_logs.whole", handler) as logger:
        yield logger, out


WHEN = '"time": "2025-12-03T18:20:00.250+00:00"'
HEAD = f'{{{WHEN}, "level": "info", "service": "gpufed-test", "logger": "gpufed.test_logs.whole"'
SPAN = '"trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "00f067aa0ba902b7"'


def test_a_line_is_written_exactly_so(stamped: tuple[logging.Logger, io.StringIO]) -> None:
    """The whole text of lines, byte for byte: keys in this order (the line's own, the span's
    ids, bound fields, `extra=` as given), values as `json.dumps(default=str)` writes them."""
    logger, out = stamped
    moment = datetime(2025, 12, 3, 18, 20, tzinfo=UTC)
    with in_span(), logs.bind(cluster="h100", cycle=7):
        logger.info(
            "job %s: %s -> %s (%s)",
            "j-1",
            "Queued",
            "Dispatched",
            "to h100",
            extra={
                "job_id": "j-1",
                "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",  # over the span's, in its place
                "cluster": "a100",  # over the bound one, in its place
                "gpus": 8,
                "share": 0.5,
                "why": None,
                "since": moment,  # not JSON: written as str() writes it
                "reasons": ["no quota", "ünïcode"],
                "_private": "left out",
            },
        )
    logger.info("nothing bound, no span")
    with logs.bind(job_id="j-9"):
        try:
            raise RuntimeError("store down")
        except RuntimeError as exc:
            error = exc
            logger.exception("commit failed")

    assert error.__traceback__ is not None
    trace_text = "".join(traceback.format_exception(error)).rstrip("\n")
    assert out.getvalue().splitlines() == [
        f'{HEAD}, "message": "job j-1: Queued -> Dispatched (to h100)", '
        '"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7", '
        '"cluster": "a100", "cycle": "7", "job_id": "j-1", "gpus": 8, "share": 0.5, '
        '"why": null, "since": "2025-12-03 18:20:00+00:00", '
        '"reasons": ["no quota", "\\u00fcn\\u00efcode"]}',
        f'{HEAD}, "message": "nothing bound, no span"}}',
        f'{HEAD.replace("info", "error")}, "message": "commit failed", "job_id": "j-9", '
        f'"exception": {json.dumps(trace_text)}}}',
    ]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param(
            {"level": "debug"},
            '"level": "debug", "service": "gpufed-test"',
            id="a field named as the line's own replaces it in its place",
        ),
        pytest.param(
            {"exception": "mine"},
            '"message": "m", "exception": "mine"}',
            id="an exception field with no exception",
        ),
    ],
)
def test_fields_named_as_the_lines_own(
    stamped: tuple[logging.Logger, io.StringIO], extra: dict[str, str], expected: str
) -> None:
    logger, out = stamped
    logger.info("m", extra=extra)
    [line] = out.getvalue().splitlines()
    assert expected in line
    assert len(json.loads(line)) == line.count('": ')  # no key twice


def test_a_value_that_holds_itself_is_refused_as_json_refuses_it(
    stamped: tuple[logging.Logger, io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    errors: list[BaseException | None] = []
    logger, out = stamped
    handler = logger.handlers[0]
    monkeypatch.setattr(handler, "handleError", lambda record: errors.append(sys.exc_info()[1]))
    loop: list[object] = []
    loop.append(loop)
    logger.info("m", extra={"loop": loop})
    logger.info("after", extra={"fine": [1]})

    assert [type(e) for e in errors] == [ValueError]
    assert "Circular reference" in str(errors[0])
    [line] = out.getvalue().splitlines()
    assert line.endswith('"message": "after", "fine": [1]}')
