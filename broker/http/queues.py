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

from broker.api import queues as api
from broker.http import auth, clusters, jobs, problems
from broker.scheduler import registry, usage


def _require_admin(request: web.Request) -> None:
    principal = auth.require_user(request)
    if not principal.is_admin:
        raise problems.Problem(403, "Forbidden", "only the admin token manages queues")


def _registry(request: web.Request) -> registry.QueueRegistry:
    return request.app[jobs.QUEUES]


def _fleet_gpus(request: web.Request) -> dict[str, int]:
    fleet = request.app[clusters.FLEET]
    return fleet.snapshot(now=time.monotonic()).total_gpus()


def build_views(request: web.Request) -> list[api.QueueView]:
    lifecycle = request.app[jobs.LIFECYCLE]
    return usage.build_views(
        _registry(request).config,
        running=lifecycle.running_jobs(),
        pending=lifecycle.pending(),
        fleet_gpus=_fleet_gpus(request),
        preemptions=lifecycle.preemptions,
    )


def _dump(model: pydantic.BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


async def list_queues(request: web.Request) -> web.Response:
    _require_admin(request)
    config = _registry(request).config
    body = api.QueueList(items=build_views(request), warnings=config.warnings(_fleet_gpus(request)))
    return web.json_response(_dump(body))


async def get_queue(request: web.Request) -> web.Response:
    _require_admin(request)
    name = request.match_info["name"]
    for view in build_views(request):
        if view.name == name:
            return web.json_response(_dump(view))
    raise problems.Problem(404, "Not found", f"no queue {name!r}")


async def _read_spec(request: web.Request, name: str) -> api.Queue:
    raw = await request.read()
    try:
        document = yaml.safe_load(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, yaml.YAMLError):
        raise problems.Problem(400, "Malformed body", "the body is not JSON or YAML") from None
    if not isinstance(document, dict):
        raise problems.Problem(422, "Invalid queue", "the body must be a queue object")
    if document.pop("name", name) != name:
        raise problems.Problem(
            422, "Invalid queue", f"name: must be {name!r}, as in the path", field="name"
        )
    try:
        api.QueueSpec.model_validate(document)
        return api.Queue.model_validate({**document, "name": name})
    except pydantic.ValidationError as exc:
        problem = problems.from_validation(exc)
        problem.title = "Invalid queue"
        raise problem from None


async def put_queue(request: web.Request) -> web.Response:
    _require_admin(request)
    name = request.match_info["name"]
    queues = _registry(request)
    queue = await _read_spec(request, name)
    known = {c.name for c in queues.config.priority_classes}
    if queue.priority_class is not None and queue.priority_class not in known:
        raise problems.Problem(
            422,
            "Invalid queue",
            f"priorityClass: no priority class {queue.priority_class!r} "
            f"({', '.join(sorted(known)) or 'none declared'})",
            field="priorityClass",
        )
    created = queues.config.queue(name) is None
    try:
        await queues.put(queue)
    except pydantic.ValidationError as exc:
        problem = problems.from_validation(exc)
        problem.title = "Invalid queue"
        raise problem from None
    view = next(v for v in build_views(request) if v.name == name)
    headers = {}
    if view.warnings:
        headers["Warning"] = ", ".join(f'299 gpufed "{w}"' for w in view.warnings)
    return web.json_response(_dump(view), status=201 if created else 200, headers=headers)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/queues", list_queues)
    app.router.add_get("/v1/queues/{name}", get_queue)
    app.router.add_put("/v1/queues/{name}", put_queue)
