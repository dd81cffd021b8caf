"""The audit trail: one JSON line for every call that changes something, and for every
credential refused.

`middleware` (the outermost: it sees the status the client got, after `problems` mapped the
error) writes a line to `--audit-log` (a file, appended to; `-`: stdout) for

- every mutating call — `POST /v1/jobs` (job.submit), `POST /v1/jobs:batch`
  (job.submit_batch), `DELETE /v1/jobs/{id}` (job.cancel), `PUT`/`DELETE /v1/queues/{name}`
  (queue.put, queue.delete) — whatever its result;
- every 401 (authenticate: no token, an unknown, expired or unverifiable one) and 403
  (authorize: a role the route does not allow) on any route;
- an agent session refused: 401/403 on the upgrade, or closed 4003 (agent.connect: a hello
  for a cluster its token or certificate does not name).

    {"time": "2026-12-01T10:00:00.123Z", "action": "job.cancel", "result": 202,
     "who": "ci-a", "via": "token", "tenant": "team-a", "role": "submitter",
     "target": "j-4f2a", "method": "DELETE", "path": "/v1/jobs/j-4f2a",
     "trace_id": "4bf92f35…", "source": "10.0.0.7"}

`who` is the token's `name` in the tokens file or the OIDC user (none for a token without a
name: `role` and `tenant` still say whose it was); never a token. `reason` is the problem's
title on a refusal. Reads are not audited (the access log is not this). Lines are written
and flushed as they come: a broker killed mid-way loses none it answered.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from aiohttp import web
from opentelemetry import trace

from broker.dispatch import connecting
from broker.http import auth

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ACTIONS = {
    ("POST", "/v1/jobs"): "job.submit",
    ("POST", "/v1/jobs:batch"): "job.submit_batch",
    ("DELETE", "/v1/jobs/{job_id}"): "job.cancel",
    ("PUT", "/v1/queues/{name}"): "queue.put",
    ("DELETE", "/v1/queues/{name}"): "queue.delete",
}
AGENT_ROUTE = "/v1/agents/connect"
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REFUSED_HELLO = 4003  # dispatch.connecting: the first frame is not hello for this cluster
CLIENT_GONE = 499  # the client closed the connection before the answer (nginx's code)


class AuditLog:
    """Where the lines go: a file (appended, one flush a line) or stdout."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._out: IO[str]
        if target == "-":
            self._out, self._owned = sys.stdout, False
        else:
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._out, self._owned = path.open("a", encoding="utf-8"), True

    def write(self, line: dict[str, Any]) -> None:
        self._out.write(json.dumps(line, separators=(",", ":"), default=str) + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._owned:
            self._out.close()


AUDIT = web.AppKey("audit", AuditLog)


def install(app: web.Application, target: str) -> AuditLog:
    """Audit `app`'s calls to `target` (a path, or `-` for stdout); closed with the app."""
    log = AuditLog(target)
    app[AUDIT] = log

    async def close(app: web.Application) -> None:
        log.close()

    app.on_cleanup.append(close)
    return log


def action_of(method: str, route: str, status: int | None) -> str | None:
    """What the line calls the request; None: it leaves no line."""
    if route == AGENT_ROUTE:
        refused = status in (401, 403, REFUSED_HELLO)
        return "agent.connect" if refused else None
    if method in MUTATING:
        return ACTIONS.get((method, route), f"{method} {route or '?'}")
    if status == 401:
        return "authenticate"
    if status == 403:
        return "authorize"
    return None


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    log = request.app.get(AUDIT)
    if log is None:
        return await handler(request)
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # what `problems` lets through (redirects, 101s)
        _record(log, request, exc.status, exc)
        raise
    except asyncio.CancelledError:
        _record(log, request, CLIENT_GONE, None)
        raise
    except Exception:
        _record(log, request, 500, None)
        raise
    refused = request.get(connecting.REFUSED_HELLO)
    _record(log, request, REFUSED_HELLO if refused else response.status, response)
    return response


def _record(
    log: AuditLog, request: web.Request, status: int, response: web.StreamResponse | None
) -> None:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else ""
    action = action_of(request.method, route, status)
    if action is None:
        return
    principal = request.get(auth.PRINCIPAL)
    line: dict[str, Any] = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "action": action,
        "result": status,
        "who": principal.label if principal is not None else None,
        "via": principal.via if principal is not None else None,
        "tenant": principal.tenant if principal is not None else None,
        "role": _role(principal),
        "target": _target(request, route, response),
        "method": request.method,
        "path": request.path,
        "trace_id": _trace_id(request),
        "source": request.remote,
    }
    if status >= 400 and isinstance(response, web.Response):
        line["reason"] = _reason(response)
    elif status == REFUSED_HELLO:
        line["reason"] = request.get(connecting.REFUSED_HELLO)
    log.write(line)


def _role(principal: auth.Principal | None) -> str | None:
    if principal is None:
        return None
    if principal.cluster is not None:
        return f"agent:{principal.cluster}"
    return principal.role.value


def _target(
    request: web.Request, route: str, response: web.StreamResponse | None
) -> str | list[str] | None:
    """The job or queue the call is about; a submit's new job (its Location), a batch's."""
    for name in ("job_id", "name"):
        if name in request.match_info:
            return request.match_info[name]
    if response is None or response.status >= 300:
        return None
    location = response.headers.get("Location", "")
    if location.startswith("/v1/jobs/"):
        return location.removeprefix("/v1/jobs/")
    if route == "/v1/jobs:batch" and isinstance(response, web.Response) and response.text:
        try:
            items = json.loads(response.text).get("items", [])
        except (ValueError, AttributeError):
            return None
        return [item["id"] for item in items if isinstance(item, dict) and item.get("id")]
    return None


def _reason(response: web.Response) -> str | None:
    """The refusal's problem title (`problems` answers every 4xx/5xx with one)."""
    if not response.text or "json" not in (response.content_type or ""):
        return response.reason
    try:
        body = json.loads(response.text)
    except ValueError:
        return response.reason
    title = body.get("title") if isinstance(body, dict) else None
    detail = body.get("detail") if isinstance(body, dict) else None
    return f"{title}: {detail}" if title and detail else title or response.reason


def _trace_id(request: web.Request) -> str | None:
    """The request's span's trace (the server instrumentation's), else its traceparent's."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        return f"{context.trace_id:032x}"
    parts = request.headers.get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None
