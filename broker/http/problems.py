"""The one middleware that turns errors into HTTP answers (problem JSON, RFC 9457).

Handlers raise the domain errors of `broker.api.errors` (or let pydantic and store errors
through); this module alone maps them to a status. Every 4xx names the field or the reason;
an unexpected error is a 500 that says so and logs the traceback, never a half-written job.
Store faults say which: unreachable (503, `Retry-After`), full (507, `store-full`), read-only
(503, `store-read-only`); nothing of the request was written in any of them. A batch submit
answers each item on its own: `problem_of` and `body_of` give the same status and problem
an item's refusal would have had alone (`http/admitting`), `relocated` names its field
from the batch's root.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pydantic
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from broker.api import errors
from broker.state import errors as store_errors

logger = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class StoreFull(errors.GpufedError):
    """The store has no room: nothing was written, and nothing will be until space is freed."""

    title = "Store full"
    problem_type = "urn:gpufed:problem:store-full"


class StoreReadOnly(errors.Unavailable):
    """The store refuses writes: nothing was written; an operator must make it writable."""

    title = "Store read-only"
    problem_type = "urn:gpufed:problem:store-read-only"


STATUS: dict[type[errors.GpufedError], int] = {
    StoreFull: 507,  # Insufficient Storage: exactly this; not retried by generic clients
    errors.Malformed: 400,
    errors.Unauthenticated: 401,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.TooLarge: 413,
    errors.Invalid: 422,
    errors.TooManyRequests: 429,
    errors.RequestTimeout: 408,
    errors.Unavailable: 503,
}


def status_of(error: errors.GpufedError) -> int:
    for kind in type(error).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


def body_of(
    error: errors.GpufedError, instance: str, *, status: int | None = None
) -> dict[str, Any]:
    """The problem JSON of `error` (what `respond` sends; a batch item's `problem`)."""
    code = status if status is not None else status_of(error)
    body: dict[str, Any] = {
        "type": error.problem_type,
        "title": error.title,
        "status": code,
        "detail": error.detail,
        "instance": instance,
    }
    if error.field:
        body["field"] = error.field
    if error.errors:
        body["errors"] = error.errors
    for name, value in error.extensions.items():
        body.setdefault(name, value)
    return body


def respond(error: errors.GpufedError, instance: str, *, status: int | None = None) -> web.Response:
    body = body_of(error, instance, status=status)
    return web.Response(
        status=body["status"],
        text=json.dumps(body),
        content_type=PROBLEM_JSON,
        headers=error.headers,
    )


def relocated(error: errors.GpufedError, where: str) -> errors.GpufedError:
    """`error`, its fields named from `where` on (a batch item's job: `items[3].job`):
    `spec.queue` becomes `items[3].job.spec.queue`, in `field`, `errors` and the detail's
    leading field. Changes `error` itself (one just raised) and returns it."""
    if not where:
        return error
    if error.field:
        old = error.field
        error.field = f"{where}.{old}"
        if error.detail.startswith(f"{old}: "):
            error.detail = f"{error.field}: {error.detail[len(old) + 2 :]}"
    else:
        error.field = where
    for item in error.errors:
        if item.get("field"):
            item["field"] = f"{where}.{item['field']}"
    return error


def field_path(loc: Sequence[int | str]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def from_validation(
    exc: pydantic.ValidationError, *, prefix: str = "", title: str = "Invalid job"
) -> errors.Invalid:
    """A pydantic error as an Invalid naming each field (the first one in `detail`)."""
    items = []
    for error in exc.errors(include_url=False):
        path = field_path(error["loc"])
        message = str(error["msg"])
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        head, sep, rest = message.partition(": ")
        if sep and " " not in head:
            # model-level checks say which field they mean, relative to where they ran:
            # "gang.minMember: why" inside spec, "spec.tasks[0]...: why" at the top
            path = f"{path}.{head}" if path else head
            message = rest
        if error["type"] == "extra_forbidden":
            message = "unknown field"
        path = f"{prefix}{path}" if prefix and path else path or prefix.rstrip(".")
        items.append({"field": path, "message": message})
    first = items[0] if items else {"field": "", "message": "invalid"}
    return errors.Invalid(
        f"{first['field']}: {first['message']}" if first["field"] else first["message"],
        field=first["field"] or None,
        title=title,
        errors=items,
    )


def problem_of(exc: BaseException, *, where: str) -> tuple[errors.GpufedError, int]:
    """The domain error `exc` is and its status, as the API answers it: the one mapping of
    the middleware and of a batch's items. A store fault says which (logged); anything
    unexpected is a 500 that says so, its traceback logged (`where`: the request)."""
    if isinstance(exc, errors.GpufedError):
        return exc, status_of(exc)
    if isinstance(exc, pydantic.ValidationError):
        invalid = from_validation(exc)
        return invalid, status_of(invalid)
    if isinstance(exc, store_errors.TemporaryStoreError):
        logger.warning("store unavailable: %s", exc)
        unavailable = errors.Unavailable(
            "the broker's store did not answer; retry",
            title="Store unavailable",
            headers={"Retry-After": "1"},
        )
        return unavailable, status_of(unavailable)
    if isinstance(exc, store_errors.StoreFullError):
        logger.error("store full, write refused: %s", exc)
        full = StoreFull(
            "the broker's store is full; nothing was written (an operator must free space)"
        )
        return full, status_of(full)
    if isinstance(exc, store_errors.StoreReadOnlyError):
        logger.error("store read-only, write refused: %s", exc)
        read_only = StoreReadOnly(
            "the broker's store refuses writes; nothing was written (an operator must act)"
        )
        return read_only, status_of(read_only)
    logger.error("unhandled error on %s", where, exc_info=exc)
    return errors.GpufedError("the broker failed; see its logs", title="Internal error"), 500


@web.middleware
async def problems_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        too_large = errors.TooLarge(exc.text or "the body is over 1 MiB", title="Body too large")
        return _refused(request, too_large, None)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kept = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        plain = errors.GpufedError(exc.text or exc.reason, title=exc.reason, headers=kept)
        return _refused(request, plain, exc.status)
    except Exception as exc:
        error, status = problem_of(exc, where=f"{request.method} {request.path}")
        return _refused(request, error, status)


def _refused(request: web.Request, error: errors.GpufedError, status: int | None) -> web.Response:
    """The problem answer; a client's mistake (4xx) logged in one line, never a traceback
    (429s at debug: a flood must not flood the log too)."""
    answer = respond(error, request.path, status=status)
    if 400 <= answer.status < 500:
        level = logging.DEBUG if answer.status == 429 else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(
                level,
                "%s %s from %s: %d %s: %s",
                request.method,
                request.path,
                request.remote,
                answer.status,
                error.title,
                error.detail,
            )
    return answer


class OneLineClientErrors(logging.Filter):
    """aiohttp's own log of a request it cannot parse (a bad request line, header or
    Content-Length: a 400 before any handler): one line at info, the traceback only when
    `aiohttp.server` logs at debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or not 400 <= (exc.code or 0) < 500:
            return True
        if record.levelno > logging.INFO:
            record.levelno, record.levelname = logging.INFO, "INFO"
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            message = " ".join(str(exc.message).split())
            record.msg = f"{record.getMessage()}: {exc.code} {type(exc).__name__}: {message}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(record.levelno)


def quiet_client_errors() -> None:
    """Install `OneLineClientErrors` on aiohttp's server logger (once per process)."""
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineClientErrors) for f in server.filters):
        server.addFilter(OneLineClientErrors())
