"""The one middleware that turns errors into HTTP answers (problem JSON, RFC 9457).

Handlers raise the domain errors of `broker.api.errors` (or let pydantic and store errors
through); this module alone maps them to a status. Every 4xx names the field or the reason;
an unexpected error is a 500 that says so and logs the traceback, never a half-written job.
Store faults say which: unreachable (503, `Retry-After`), full (507, `store-full`), read-only
(503, `store-read-only`); nothing of the request was written in any of them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pydantic
from aiohttp import web

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
    errors.Unavailable: 503,
}


def status_of(error: errors.GpufedError) -> int:
    for kind in type(error).__mro__:
        if kind in STATUS:
            return STATUS[kind]
    return 500


def respond(error: errors.GpufedError, instance: str, *, status: int | None = None) -> web.Response:
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
    return web.Response(
        status=code, text=json.dumps(body), content_type=PROBLEM_JSON, headers=error.headers
    )


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


@web.middleware
async def problems_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.GpufedError as error:
        return respond(error, request.path)
    except pydantic.ValidationError as exc:
        return respond(from_validation(exc), request.path)
    except web.HTTPRequestEntityTooLarge as exc:
        too_large = errors.TooLarge(exc.text or "the body is over 1 MiB", title="Body too large")
        return respond(too_large, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kept = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        plain = errors.GpufedError(exc.text or exc.reason, title=exc.reason, headers=kept)
        return respond(plain, request.path, status=exc.status)
    except store_errors.TemporaryStoreError as exc:
        logger.warning("store unavailable: %s", exc)
        unavailable = errors.Unavailable(
            "the broker's store did not answer; retry",
            title="Store unavailable",
            headers={"Retry-After": "1"},
        )
        return respond(unavailable, request.path)
    except store_errors.StoreFullError as exc:
        logger.error("store full, write refused: %s", exc)
        full = StoreFull(
            "the broker's store is full; nothing was written (an operator must free space)"
        )
        return respond(full, request.path)
    except store_errors.StoreReadOnlyError as exc:
        logger.error("store read-only, write refused: %s", exc)
        read_only = StoreReadOnly(
            "the broker's store refuses writes; nothing was written (an operator must act)"
        )
        return respond(read_only, request.path)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        failed = errors.GpufedError("the broker failed; see its logs", title="Internal error")
        return respond(failed, request.path, status=500)
