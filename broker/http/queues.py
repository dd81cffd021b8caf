"""Queue routes: list, get, put and delete queues with usage and warnings.

Who may (`broker.http.roles`): the admin every queue; a tenant's tokens read the queues of
their tenant (and the open queues their unfinished jobs are in), its tenant-admin puts and
deletes them: a queue of another tenant, or a PUT giving the queue to another tenant, is 403.
Another tenant's queue is not found (404) on a GET, as another tenant's job is.

`PUT /v1/queues/{name}` takes a queue spec in JSON or YAML (tenant, cohort, weight,
priorityClass, quotas per GPU model with guaranteed and limit), validates it against the rest
of the configuration (422 naming the field: guaranteed above limit, unknown priority class)
and builds its answer before storing anything, then stores it and applies it from the next
scheduling cycle. A tenant-admin's PUT must also fit its tenant's allotment, its guarantees and
limits added over all the tenant's queues (403 naming the field, nothing stored:
`broker.api.allotments`); the admin's are not bound. What can work but will disappoint — a
cohort guaranteeing more GPUs than it holds — is accepted, with the warnings in the body and
in a `Warning` header. In open queue mode a PUT declares that one queue; no other queue starts
refusing jobs.

`DELETE /v1/queues/{name}` removes what the API stored (`registry.QueueRegistry.delete`): a
queue stored through the API only, once it has no unfinished job (409 naming how many it has
otherwise), is gone (204); a queue of the file that a PUT overrode gets the file's definition
back (200, the queue as it is now); a queue only in the file is 409 (edit the file); an unknown
name is 404.

The listing holds the allotments the caller may read (a tenant's token its own tenant's, the
admin and a fleet viewer every tenant's), each with what the tenant's queues claim of it.

The listing never fails because of a job: every queue with unfinished jobs is shown, declared
or not, and in declared mode an undeclared one carries a warning (its jobs are scheduled as in
an open queue, and nothing is stranded silently).
"""

from __future__ import annotations

import time
from typing import Any

import pydantic
import yaml
from aiohttp import web

from broker.api import allotments, errors, jobs, queues, status
from broker.http import auth, keys, problems
from broker.planning import usage
from broker.state import registry

INVALID = "Invalid queue"
UNFINISHED = [state for state in status.JobState if not state.terminal]


def _visible_to(request: web.Request, views: list[queues.QueueView]) -> list[queues.QueueView]:
    """The views the caller may read: every one for the admin and a fleet viewer; for a
    tenant's token, its tenant's queues and the open queues holding its unfinished jobs."""
    tenant = auth.caller(request).tenant
    if tenant is None:
        return views
    held = request.app[keys.JOBS].book.held  # each state's jobs apart: the unfinished only
    joined = {
        record.job.spec.queue
        for state in UNFINISHED
        for _, record in held.walk(newest=False, after=None, state=state)
        if record.tenant == tenant
    }
    return [
        view
        for view in views
        if view.spec.tenant == tenant or (not view.declared and view.name in joined)
    ]


def _check_owner(request: web.Request, name: str, *, tenants: set[str]) -> None:
    """Forbidden unless the caller may change queue `name`, owned by (or given to) `tenants`."""
    principal = auth.caller(request)
    foreign = sorted(t for t in tenants if t != principal.tenant)
    if principal.tenant is not None and foreign:
        raise errors.Forbidden(
            f"queue {name!r} belongs to tenant {', '.join(foreign)}: this token is "
            f"{principal.describe()}, for its own tenant's queues only"
        )


def _registry(request: web.Request) -> registry.QueueRegistry:
    return request.app[keys.QUEUES]


def _fleet_gpus(request: web.Request) -> dict[str, int]:
    work = request.app.get(keys.LEADER_WORK)
    if work is not None:  # a follower counts the GPUs the leader published
        return work.fleet_gpus()
    return request.app[keys.FLEET].snapshot(now=time.monotonic()).total_gpus()


def build_views(
    request: web.Request, config: queues.QueuesConfig | None = None
) -> list[queues.QueueView]:
    """The queues of `config` (default: the registry's) and every queue with jobs."""
    book = request.app[keys.JOBS]
    queue_registry = _registry(request)
    views = usage.build_views(
        config if config is not None else queue_registry.config,
        running=book.running_jobs(),
        pending=book.pending(),
        fleet_gpus=_fleet_gpus(request),
        preemptions=book.preemptions(),
    )
    return [_annotated(queue_registry, view) for view in views]


def _annotated(queue_registry: registry.QueueRegistry, view: queues.QueueView) -> queues.QueueView:
    update: dict[str, Any] = {"source": queue_registry.source(view.name)}
    if not view.declared and queue_registry.declared:
        update["warnings"] = [*view.warnings, undeclared_warning(view)]
    return view.model_copy(update=update)


def undeclared_warning(view: queues.QueueView) -> str:
    jobs_count = view.status.pending_jobs + view.status.running_jobs
    text = (
        f"queue {view.name} is not declared (queue mode declared) but has {jobs_count} "
        "unfinished jobs: they are scheduled as in an open queue (no guarantee, no limit)"
    )
    try:
        jobs.ObjectMeta._dns_label(view.name)
    except ValueError:
        return f"{text}; its name is not a DNS label, so cancel them and submit them again"
    return f"{text}; declare it (PUT /v1/queues/{view.name}) or cancel them"


def _dump(model: pydantic.BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


async def list_queues(request: web.Request) -> web.Response:
    queue_registry = _registry(request)
    views = _visible_to(request, build_views(request))
    tenant = auth.caller(request).tenant  # None: the fleet's (the admin, a fleet viewer)
    # the configuration's warnings name other tenants' queues and cohorts: the fleet's only
    warnings = queue_registry.config.warnings(_fleet_gpus(request)) if tenant is None else []
    warnings += [undeclared_warning(v) for v in views if not v.declared and queue_registry.declared]
    tenants = queue_registry.tenants() if tenant is None else [tenant]
    shares = [allotment_view(queue_registry, name) for name in tenants]
    body = queues.QueueList(
        mode=queue_registry.mode, items=views, warnings=warnings, allotments=shares
    )
    return web.json_response(_dump(body))


def allotment_view(queue_registry: registry.QueueRegistry, tenant: str) -> queues.AllotmentView:
    """`tenant`'s allotment, what its declared queues claim of it, and where they claim more
    (the admin put them there: its tenant-admin may lower them, not raise them)."""
    allotment, declared = queue_registry.allotment(tenant)
    mine = [q for q in queue_registry.config.queues if q.tenant == tenant]
    return queues.AllotmentView(
        tenant=tenant,
        declared=declared,
        allotment=allotment,
        uses=allotments.uses(allotment, mine),
        warnings=allotments.overdrawn(allotment, mine),
    )


async def get_queue(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    for view in _visible_to(request, build_views(request)):
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


def _validated(queue_registry: registry.QueueRegistry, queue: queues.Queue) -> queues.QueuesConfig:
    """The configuration with `queue`; Invalid (naming the field) if it cannot work."""
    known = {c.name for c in queue_registry.config.priority_classes}
    if queue.priority_class is not None and queue.priority_class not in known:
        raise errors.Invalid(
            f"priorityClass: no priority class {queue.priority_class!r} "
            f"({', '.join(sorted(known)) or 'none declared'})",
            field="priorityClass",
            title=INVALID,
        )
    try:
        return queue_registry.config.with_queue(queue)
    except pydantic.ValidationError as exc:
        raise problems.from_validation(exc, title=INVALID) from None


async def put_queue(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    queue_registry = _registry(request)
    queue = await _read_spec(request, name)
    existing = queue_registry.config.queue(name)
    _check_owner(request, name, tenants={queue.tenant} | ({existing.tenant} if existing else set()))
    candidate = _validated(queue_registry, queue)
    # the answer is built before anything is stored: a PUT that fails stores nothing
    view = next(v for v in build_views(request, candidate) if v.name == name)
    created = queue_registry.config.queue(name) is None
    try:  # a tenant-admin's queue must fit its tenant's allotment; the admin's need not
        await queue_registry.put(queue, bounded=auth.caller(request).tenant is not None)
    except pydantic.ValidationError as exc:  # the configuration changed meanwhile
        raise problems.from_validation(exc, title=INVALID) from None
    view = view.model_copy(update={"source": queue_registry.source(name)})
    headers = {}
    if view.warnings:
        headers["Warning"] = ", ".join(f'299 gpufed "{w}"' for w in view.warnings)
    return web.json_response(_dump(view), status=201 if created else 200, headers=headers)


async def delete_queue(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    queue_registry = _registry(request)
    source = queue_registry.source(name)
    declared = queue_registry.config.queue(name)
    if source is None or declared is None:
        raise errors.NotFound(f"no queue {name!r}")
    _check_owner(request, name, tenants={declared.tenant})
    if source == queues.QueueSource.FILE:
        raise errors.Conflict(
            f"queue {name!r} is declared in the queues file; the API deletes only what it "
            "stored: remove it from the file and restart the broker",
            title="Queue from the queues file",
        )
    if source == queues.QueueSource.API:
        unfinished = request.app[keys.JOBS].unfinished_in_queue(name)
        if unfinished:
            states = ", ".join(f"{n} {state.value}" for state, n in sorted(unfinished.items()))
            raise errors.Conflict(
                f"queue {name!r} has {sum(unfinished.values())} unfinished jobs ({states}): "
                "cancel them or wait until they finish",
                title="Queue not empty",
            )
    await queue_registry.delete(name)
    if source == queues.QueueSource.OVERRIDE:  # the file's definition applies again
        view = next(v for v in build_views(request) if v.name == name)
        return web.json_response(_dump(view))
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/queues", list_queues)
    app.router.add_get("/v1/queues/{name}", get_queue)
    app.router.add_put("/v1/queues/{name}", put_queue)
    app.router.add_delete("/v1/queues/{name}", delete_queue)
