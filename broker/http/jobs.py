"""Job routes: submit (idempotent), get, list, cancel, why."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

import pydantic
import yaml
from aiohttp import web

from broker.api import jobs, status
from broker.api import queues as queues_api
from broker.dispatch import lifecycle as lifecycle_
from broker.dispatch import transitions
from broker.http import auth, problems
from broker.scheduler import quotas, registry
from broker.telemetry import jobspans, tracing

LIFECYCLE = web.AppKey("lifecycle", lifecycle_.Lifecycle)
QUEUES = web.AppKey("queues", registry.QueueRegistry)
MAX_BODY = 1024 * 1024
_ID_CHARS = string.ascii_lowercase + string.digits
YAML_TYPES = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}


def new_job_id(name: str) -> str:
    return f"{name[:50].rstrip('-')}-{''.join(secrets.choice(_ID_CHARS) for _ in range(8))}"


async def _read_document(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        raise problems.Problem(400, "Empty body", "the body must be a GPUJob in JSON or YAML")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise problems.Problem(400, "Malformed body", "the body is not UTF-8 text") from None
    if request.content_type in YAML_TYPES:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise problems.Problem(
                400, "Malformed YAML", f"the body is not valid YAML{where}"
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise problems.Problem(
            400, "Malformed JSON", f"the body is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None


def _visible(request: web.Request, record: status.JobRecord | None) -> status.JobRecord:
    principal = auth.require_user(request)
    if record is None or (not principal.is_admin and record.tenant != principal.name):
        raise problems.Problem(404, "Not found", f"no job {request.match_info['job_id']!r}")
    return record


def _dump(model: pydantic.BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


async def submit(request: web.Request) -> web.Response:
    principal = auth.require_user(request)
    if principal.kind != "tenant":
        raise problems.Problem(403, "Forbidden", "only tenant tokens submit jobs")
    document = await _read_document(request)
    if not isinstance(document, dict):
        raise problems.Problem(422, "Invalid job", "the body must be a GPUJob object")
    job = jobs.GPUJob.model_validate(document)
    _check_queue(request, principal.name, job)
    lifecycle = request.app[LIFECYCLE]
    key = request.headers.get("Idempotency-Key")
    if key is not None and not 1 <= len(key) <= 255:
        raise problems.Problem(400, "Bad Idempotency-Key", "Idempotency-Key: 1 to 255 characters")
    if key:
        existing = await lifecycle.jobs.find_idempotent(principal.name, key)
        if existing is not None:
            return _submitted(existing, replayed=True)
    traceparent, parent = lifecycle.spans.new_trace()
    record = status.JobRecord(
        id=new_job_id(job.metadata.name),
        tenant=principal.name,
        job=job,
        traceparent=traceparent,
        trace_parent=parent,
        trace_id=traceparent.split("-")[1],
        idempotency_key=key,
    )
    with jobspans.tracer.start_as_current_span(
        "job.submit",
        context=tracing.context_of(traceparent),
        attributes={
            "gpufed.job": record.id,
            "gpufed.tenant": record.tenant,
            "gpufed.queue": job.spec.queue,
        },
    ):
        stored = await lifecycle.submit(record)
    return _submitted(stored, replayed=stored is not record)


def _submitted(record: status.JobRecord, *, replayed: bool) -> web.Response:
    body = status.SubmitResponse(id=record.id, state=record.status.state, trace_id=record.trace_id)
    headers = {"Location": f"/v1/jobs/{record.id}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return web.json_response(_dump(body), status=202, headers=headers)


async def get_job(request: web.Request) -> web.Response:
    lifecycle = request.app[LIFECYCLE]
    record = _visible(request, lifecycle.jobs.get(request.match_info["job_id"]))
    body = _dump(record)
    waiting = lifecycle.why.get(record.id)
    if waiting and record.status.state == status.JobState.QUEUED:
        # the latest cycle's reasons (kept in memory, not stored): what `gpufed get` shows
        body["status"]["reasons"] = list(waiting)
    return web.json_response(body)


async def list_jobs(request: web.Request) -> web.Response:
    principal = auth.require_user(request)
    queue = request.query.get("queue")
    state = request.query.get("state")
    if state is not None and state not in {s.value for s in status.JobState}:
        raise problems.Problem(
            400,
            "Bad query",
            f"state: one of {', '.join(s.value for s in status.JobState)}",
            field="state",
        )
    try:
        limit = int(request.query.get("limit", "1000"))
    except ValueError:
        raise problems.Problem(400, "Bad query", "limit: a whole number", field="limit") from None
    items = [
        record
        for record in request.app[LIFECYCLE].jobs
        if (principal.is_admin or record.tenant == principal.name)
        and (queue is None or record.job.spec.queue == queue)
        and (state is None or record.status.state == state)
    ]
    items.sort(key=lambda r: r.created, reverse=True)
    return web.json_response(_dump(status.JobList(items=items[: max(0, limit)])))


async def cancel_job(request: web.Request) -> web.Response:
    lifecycle = request.app[LIFECYCLE]
    record = _visible(request, lifecycle.jobs.get(request.match_info["job_id"]))
    await lifecycle.cancel(record)
    return web.json_response(_dump(record), status=202)


def _check_queue(request: web.Request, tenant: str, job: jobs.GPUJob) -> None:
    queues = request.app.get(QUEUES)
    if queues is None:
        return
    try:
        queues.check_job(tenant, job)
    except registry.QueueError as exc:
        title = "Forbidden" if exc.status == 403 else "Invalid job"
        raise problems.Problem(exc.status, title, str(exc), field=exc.field) from None


async def why(request: web.Request) -> web.Response:
    lifecycle = request.app[LIFECYCLE]
    record = _visible(request, lifecycle.jobs.get(request.match_info["job_id"]))
    answer = why_answer(record, lifecycle, request.app.get(QUEUES))
    return web.json_response(answer.model_dump(mode="json", by_alias=True))


def why_answer(
    record: status.JobRecord,
    lifecycle: lifecycle_.Lifecycle,
    queues: registry.QueueRegistry | None,
) -> queues_api.WhyAnswer:
    """Per cluster, the sorted reasons the job is not placed: codes and plain words."""
    reasons = [
        queues_api.WhyReason(cluster=r.cluster, code=r.code, message=r.message)
        for r in lifecycle.why_details.get(record.id, ())
    ]
    if not reasons:  # an agent's rejection, kept with the job
        for text in record.status.reasons:
            cluster, _, message = text.partition(": ")
            reasons.append(
                queues_api.WhyReason(
                    cluster=cluster, code=queues_api.ReasonCode.REJECTED, message=message
                )
            )
    reasons.sort(key=lambda r: (r.cluster, r.code.value, r.message))
    by_cluster: dict[str, list[queues_api.WhyReason]] = {}
    for reason in reasons:
        by_cluster.setdefault(reason.cluster, []).append(reason)
    spec = record.job.spec
    tenancy = quotas.Tenancy(queues.config if queues is not None else None)
    return queues_api.WhyAnswer(
        id=record.id,
        state=record.status.state.value,
        placed=record.status.state != status.JobState.QUEUED,
        queue=spec.queue,
        priority=tenancy.priority_of(spec.queue, spec.priority, spec.priority_class),
        clusters=[
            queues_api.WhyCluster(
                cluster=cluster,
                codes=[r.code for r in items],
                reasons=[r.message for r in items],
            )
            for cluster, items in by_cluster.items()
        ],
        reasons=reasons,
        message="; ".join(f"{r.cluster}: {r.message}" for r in reasons)
        if reasons
        else _plain_state(record, lifecycle),
    )


def _plain_state(record: status.JobRecord, lifecycle: lifecycle_.Lifecycle) -> str:
    state = record.status.state
    last = record.status.events[-1] if record.status.events else None
    if state == status.JobState.QUEUED:
        if last is not None and last.reason == transitions.PREEMPTED:
            return f"preempted ({last.message}); waiting for the next scheduling cycle"
        return "waiting for the next scheduling cycle"
    if state.terminal:
        return f"finished: {state.value}"
    preempting = lifecycle.preempting.get(record.id)
    if preempting is not None:
        return f"{state.value} on {record.status.cluster}; being {preempting.message}"
    return f"{state.value} on {record.status.cluster}"


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", cancel_job)
    app.router.add_get("/v1/jobs/{job_id}/why", why)
