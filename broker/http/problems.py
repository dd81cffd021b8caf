"""Errors of the HTTP boundary and the one middleware that turns them into problem JSON.

Handlers raise `Problem` (or let pydantic/store errors through); nothing else builds error
responses. Every 4xx names the field or the reason; an unexpected error is a 500 that says
so and logs the traceback, never a half-written job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pydantic
from aiohttp import web

from broker.state import errors as store_errors

logger = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Problem(Exception):
    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        field: str | None = None,
        errors: Sequence[dict[str, Any]] = (),
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.field = field
        self.errors = list(errors)
        self.headers = headers or {}


def respond(problem: Problem, instance: str) -> web.Response:
    body: dict[str, Any] = {
        "type": "about:blank",
        "title": problem.title,
        "status": problem.status,
        "detail": problem.detail,
        "instance": instance,
    }
    if problem.field:
        body["field"] = problem.field
    if problem.errors:
        body["errors"] = problem.errors
    return web.Response(
        status=problem.status,
        text=json.dumps(body),
        content_type=PROBLEM_JSON,
        headers=problem.headers,
    )


def field_path(loc: Sequence[int | str]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def from_validation(exc: pydantic.ValidationError, *, prefix: str = "") -> Problem:
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
    return Problem(
        422,
        "Invalid job",
        f"{first['field']}: {first['message']}" if first["field"] else first["message"],
        field=first["field"] or None,
        errors=items,
    )


@web.middleware
async def problems_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Problem as problem:
        return respond(problem, request.path)
    except pydantic.ValidationError as exc:
        return respond(from_validation(exc), request.path)
    except web.HTTPRequestEntityTooLarge as exc:
        return respond(
            Problem(413, "Body too large", exc.text or "the body is over 1 MiB"), request.path
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return respond(Problem(exc.status, exc.reason, exc.text or exc.reason), request.path)
    except store_errors.TemporaryStoreError as exc:
        logger.warning("store unavailable: %s", exc)
        return respond(
            Problem(
                503,
                "Store unavailable",
                "the broker's store did not answer; retry",
                headers={"Retry-After": "1"},
            ),
            request.path,
        )
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return respond(
            Problem(500, "Internal error", "the broker failed; see its logs"), request.path
        )
