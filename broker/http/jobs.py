"""Job routes: submit (idempotent; a batch and the checks: `admitting`), get, list, cancel, why."""

from __future__ import annotations

from typing import Any

import pydantic
from aiohttp import web

from broker.api import errors, queues, status, submits
from broker.http import admitting, auth, documents, forwarding, keys, listing
from broker.jobs import positions, service, starting, submitting, transitions
from broker.planning import dependencies as planning_deps
from broker.planning import planning, quotas
from broker.state import registry

MAX_BODY = 1024 * 1024


async def _read_document(request: web.Request) -> Any:
    return documents.read_document(
        await request.read(), content_type=request.content_type, what="a GPUJob"
    )


def _visible(request: web.Request, record: status.JobRecord | None) -> status.JobRecord:
    if record is None or not auth.caller(request).sees(record.tenant):
        raise errors.NotFound(f"no job {request.match_info['job_id']!r}")
    return record


async def _find(request: web.Request, book: service.Jobs) -> status.JobRecord:
    """The job of the path, if the caller may see it; read from the store if this replica
    has not seen it yet (a submit answered by another replica)."""
    return _visible(request, await book.find(request.match_info["job_id"]))


def _dump(model: pydantic.BaseModel) -> dict[str, Any]:
    if isinstance(model, status.JobRecord | status.JobList):  # less what only the store keeps
        return model.api_json()
    return model.model_dump(mode="json", by_alias=True)


async def submit(request: web.Request) -> web.Response:
    principal = auth.caller(request)  # a tenant's (broker.http.roles)
    document = await _read_document(request)
    book = request.app[keys.JOBS]
    job = admitting.admit(
        principal,
        document,
        queues=request.app.get(keys.QUEUES),
        bounds=request.app[admitting.BOUNDS],
        interning=book.book.store.interning,
    )
    key = submits.check_idempotency_key(
        request.headers.get(admitting.KEY_HEADER), field=admitting.KEY_HEADER
    )
    stored, replayed = await submitting.submit_one(book, principal.name, job, key=key)
    return _submitted(stored, replayed=replayed)


def _submitted(record: status.JobRecord, *, replayed: bool) -> web.Response:
    body = status.SubmitResponse(
        id=record.id, state=record.status.state, trace_id=record.trace_id, array=record.array
    )
    headers = {"Location": f"/v1/jobs/{record.id}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return web.json_response(_dump(body), status=202, headers=headers)


async def get_job(request: web.Request) -> web.Response:
    book = request.app[keys.JOBS]
    record = await _find(request, book)
    body = _dump(record)
    waiting = book.waiting(record.id)
    if waiting and waiting.reasons and record.status.state == status.JobState.QUEUED:
        # the latest cycle's reasons (kept in memory, not stored): what `gpufed get` shows
        body["status"]["reasons"] = list(waiting.reasons)
    return web.json_response(body)


async def list_jobs(request: web.Request) -> web.Response:
    """One page of jobs, live and finished (`http.listing`)."""
    job_query, limit, cont = listing.parse(request, tenant=auth.caller(request).tenant)
    book = request.app[keys.JOBS]
    body = await listing.page_body(
        book.book.held,
        book.history,
        job_query,
        limit=limit,
        cont=cont,
        max_bytes=request.app[listing.PAGE_BYTES],
    )
    return web.Response(body=body, content_type="application/json")


async def cancel_job(request: web.Request) -> web.Response:
    book = request.app[keys.JOBS]
    record = await _find(request, book)
    cancelled = await book.cancel(record.id, by=auth.caller(request).describe())
    return web.json_response(_dump(cancelled or record), status=202)


async def why(request: web.Request) -> web.Response:
    """Why the job waits. The cycle's reasons live with the leader: a follower forwards
    the question for a queued job (`forwarding`), and answers from its own cache, saying so,
    when the leader does not answer."""
    book = request.app[keys.JOBS]
    record = await _find(request, book)
    leadership = request.app.get(keys.LEADERSHIP)
    asked_leader = False
    queued = record.status.state == status.JobState.QUEUED
    if queued and leadership is not None and not leadership.is_leader:
        leader = leadership.leader_url
        if forwarding.forwardable(request, leader, leadership.url):
            assert leader is not None
            asked_leader = True
            answered = await forwarding.ask_leader(request, leader)
            if answered is not None:
                return web.json_response(answered)
    work = request.app.get(keys.LEADER_WORK)
    scheduler = work.scheduler if work is not None and work.active else None
    waiting = record.status.state == status.JobState.WAITING
    answer = why_answer(
        record,
        book,
        request.app.get(keys.QUEUES),
        lines=scheduler.positions if scheduler is not None else None,
        depends=await book.dependency_verdict(record) if waiting else None,
    )
    if asked_leader and not answer.reasons:
        answer = answer.model_copy(
            update={
                "message": f"{answer.message} (the leader did not answer: its cycles hold "
                "the reasons)"
            }
        )
    return web.json_response(answer.model_dump(mode="json", by_alias=True))


def _rejections(record: status.JobRecord) -> dict[str, str]:
    """Per cluster, what its agent said when it last rejected the job (kept with the job)."""
    said: dict[str, list[str]] = {}
    for text in record.status.reasons:
        cluster, _, message = text.partition(": ")
        said.setdefault(cluster, []).append(message)
    return {cluster: "; ".join(messages) for cluster, messages in said.items()}


def why_answer(
    record: status.JobRecord,
    book: service.Jobs,
    queue_registry: registry.QueueRegistry | None,
    *,
    lines: positions.Positions | None = None,
    depends: planning_deps.Verdict | None = None,
) -> queues.WhyAnswer:
    """Per cluster, the sorted reasons the job is not placed: codes and plain words; for a
    queued job, its position and ETA from the leader's scheduler (`lines`, None: not here);
    for a waiting one, the dependencies it waits for (`depends`: what they say now)."""
    waiting = book.waiting(record.id)
    said = _rejections(record)  # what a cluster said when it "turned the job down", added
    reasons = [
        queues.WhyReason(
            cluster=r.cluster,
            code=r.code,
            message=f"{r.message}; last: {said[r.cluster]}"
            if r.code == queues.ReasonCode.REJECTED and r.cluster in said
            else r.message,
        )
        for r in (waiting.details if waiting is not None else ())
    ]
    if depends is not None and record.status.state == status.JobState.WAITING:
        reasons = [_waiting_for(text) for text in depends.waiting_for]
        if depends.failed is not None:  # the leader fails it in a moment
            reasons.append(_waiting_for(f"{depends.failed}: it fails with DependencyFailed"))
        if depends.met:
            reasons.append(_waiting_for("its dependencies are met: it is queued in a moment"))
    elif not reasons:  # an agent's rejection, kept with the job
        for text in record.status.reasons:
            cluster, _, message = text.partition(": ")
            reasons.append(
                queues.WhyReason(cluster=cluster, code=queues.ReasonCode.REJECTED, message=message)
            )
    reasons.sort(key=lambda r: (r.cluster, r.code.value, r.message))
    by_cluster: dict[str, list[queues.WhyReason]] = {}
    for reason in reasons:
        by_cluster.setdefault(reason.cluster, []).append(reason)
    spec = record.job.spec
    tenancy = quotas.Tenancy(queue_registry.config if queue_registry is not None else None)
    return queues.WhyAnswer(
        id=record.id,
        state=record.status.state.value,
        placed=record.status.state not in (status.JobState.QUEUED, status.JobState.WAITING),
        queue=spec.queue,
        priority=tenancy.priority_of(spec.queue, spec.priority, spec.priority_class),
        clusters=[
            queues.WhyCluster(
                cluster=cluster,
                codes=[r.code for r in items],
                reasons=[r.message for r in items],
            )
            for cluster, items in by_cluster.items()
        ],
        reasons=reasons,
        message="; ".join(f"{r.cluster}: {r.message}" for r in reasons)
        if reasons
        else _plain_state(record, book),
        **_in_line(record, lines),
    )


def _waiting_for(text: str) -> queues.WhyReason:
    return queues.WhyReason(
        cluster=planning.FLEET, code=queues.ReasonCode.DEPENDENCY, message=f"waits for {text}"
    )


def _in_line(record: status.JobRecord, lines: positions.Positions | None) -> dict[str, Any]:
    """`position`, `eta` and `etaReason` of a queued job (nothing for the others)."""
    if record.status.state != status.JobState.QUEUED:
        return {}
    if lines is None:
        return {"eta_reason": "this broker does not lead: the leader holds the queued jobs"}
    found = lines.answer(record.id, now=status.utcnow())
    place = found.position
    return {
        "position": None
        if place is None
        else queues.QueuePosition(
            in_queue=place.in_queue,
            competing=place.competing,
            models=list(found.models),
            gpus_ahead=place.gpus_ahead,
        ),
        "eta": found.eta,
        "eta_reason": found.reason,
    }


def _plain_state(record: status.JobRecord, book: service.Jobs) -> str:
    state = record.status.state
    last = record.status.events[-1] if record.status.events else None
    if state == status.JobState.QUEUED:
        if last is not None and last.reason == transitions.PREEMPTED:
            return f"preempted ({last.message}); waiting for the next scheduling cycle"
        return "waiting for the next scheduling cycle"
    if state == status.JobState.WAITING:
        return "waiting for its dependencies (spec.dependsOn)"
    if state.terminal:
        return f"finished: {state.value}"
    preempting = book.preempting_message(record.id)
    if preempting is not None:
        return f"{state.value} on {record.status.cluster}; being {preempting}"
    if last is not None and transitions.is_waiting_for_cluster(record):
        return f"{state.value} on {record.status.cluster}; waiting for its cluster: {last.message}"
    withdrawn = starting.last_withdrawal(record)  # a cluster that did not start it before
    if withdrawn is not None:
        return f"{state.value} on {record.status.cluster}; before: {withdrawn}"
    return f"{state.value} on {record.status.cluster}"


def add_routes(
    app: web.Application,
    *,
    bounds: submits.Bounds | None = None,
    page_bytes: int = listing.DEFAULT_PAGE_BYTES,
) -> None:
    """The job routes; `bounds`: what one submit may expand to, `page_bytes`: a list page's
    body at most (`http.listing`)."""
    app[admitting.BOUNDS] = bounds or submits.Bounds()
    app[listing.PAGE_BYTES] = page_bytes
    app.router.add_post("/v1/jobs", submit)
    app.router.add_post("/v1/jobs:batch", admitting.submit_batch)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", cancel_job)
    app.router.add_get("/v1/jobs/{job_id}/why", why)
    forwarding.install(app)  # the session a follower asks the leader with
