"""Queue routes (admin token only): list, get and put queues with their usage and warnings.

`PUT /v1/queues/{name}` takes a queue spec in JSON or YAML (tenant, cohort, weight,
priorityClass, quotas per GPU model with guaranteed and limit), validates it against the rest
of the configuration (422 naming the field: guaranteed above limit, unknown priority class),
stores it and applies it from the next scheduling cycle. What can work but will disappoint —
a cohort guaranteeing more GPUs than it holds — is accepted, with the warnings in the body
and in a `Warning` header.
"""

from __future__ import annotations

import time
from typing import Any

import pydantic
import yaml
from aiohttp import web

from broker.api import errors, queues
from broker.http import auth, keys, problems
from broker.planning import usage
from broker.state import registry

INVALID = "Invalid queue"


def _require_admin(request: web.Request) -> None:
    auth.require_admin(request, action="manages queues")


def _registry(request: web.Request) -> registry.QueueRegistry:
    return request.app[keys.QUEUES]


def _fleet_gpus(request: web.Request) -> dict[str, int]:
    return request.app[keys.FLEET].snapshot(now=time.monotonic()).total_gpus()


def build_views(request: web.Request) -> list[queues.QueueView]:
    book = request.app[keys.JOBS]
    return usage.build_views(
        _registry(request).config,
        running=book.running_jobs(),
        pending=book.pending(),
        fleet_gpus=_fleet_gpus(request),
        preemptions=book.preemptions(),
    )


def _dump(model: pydantic.BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


async def list_queues(request: web.Request) -> web.Response:
    _require_admin(request)
    config = _registry(request).config
    warnings = config.warnings(_fleet_gpus(request))
    body = queues.QueueList(items=build_views(request), warnings=warnings)
    return web.json_response(_dump(body))


async def get_queue(request: web.Request) -> web.Response:
    _require_admin(request)
    name = request.match_info["name"]
    for view in build_views(request):
        if view.name == name:
            return web.json_response(_dump(view))
    raise errors.NotFound(f"no queue {name!r}")


async def _read_spec(request: web.Request, name: str) -> queues.Queue:
    raw = await request.read()
    try:
        document = yaml.safe_load(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, yaml.YAMLError):
        raise errors.Malformed("the body is not JSON or YAML", title="Malformed body") from None
    if not isinstance(document, dict):
        raise errors.Invalid("the body must be a queue object", title=INVALID)
    if document.pop("name", name) != name:
        raise errors.Invalid(f"name: must be {name!r}, as in the path", field="name", title=INVALID)
    try:
        queues.QueueSpec.model_validate(document)
        return queues.Queue.model_validate({**document, "name": name})
    except pydantic.ValidationError as exc:
        raise problems.from_validation(exc, title=INVALID) from None


async def put_queue(request: web.Request) -> web.Response:
    _require_admin(request)
    name = request.match_info["name"]
    queue_registry = _registry(request)
    queue = await _read_spec(request, name)
    known = {c.name for c in queue_registry.config.priority_classes}
    if queue.priority_class is not None and queue.priority_class not in known:
        raise errors.Invalid(
            f"priorityClass: no priority class {queue.priority_class!r} "
            f"({', '.join(sorted(known)) or 'none declared'})",
            field="priorityClass",
            title=INVALID,
        )
    created = queue_registry.config.queue(name) is None
    try:
        await queue_registry.put(queue)
    except pydantic.ValidationError as exc:
        raise problems.from_validation(exc, title=INVALID) from None
    view = next(v for v in build_views(request) if v.name == name)
    headers = {}
    if view.warnings:
        headers["Warning"] = ", ".join(f'299 gpufed "{w}"' for w in view.warnings)
    return web.json_response(_dump(view), status=201 if created else 200, headers=headers)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/queues", list_queues)
    app.router.add_get("/v1/queues/{name}", get_queue)
    app.router.add_put("/v1/queues/{name}", put_queue)
