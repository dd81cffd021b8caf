"""What a submit means, one job or a batch: the checks both routes make, and the batch route.

`POST /v1/jobs` (`http/jobs.submit`) and `POST /v1/jobs:batch` (`submit_batch`, here) hold
every job to the same checks through the same functions: a tenant's token, the job's rules
(`admit`: `api.jobs.validate_submitted`, then the queue, `state.registry.check_job`), the
key's rule (`api.submits.check_idempotency_key`); `new_record` makes the record both store.

Both hold a request to what it expands to (`api.submits.Bounds`: jobs, their bytes and their
`dependsOn` entries, arrays counted whole; `BOUNDS`, set from the broker's flags): a single
submit past one is 422 naming the field and the bound, a batch's item past one is that
item's 422 and the items before it are stored.

A batch answers one status per item, in request order (`api.submits.BatchAnswer`). A body
that is not a batch (not JSON or YAML, over `MAX_BATCH_BYTES`, no `items`, none or over
`MAX_BATCH_ITEMS` of them) is one problem, and nothing is stored. Past that, an item that
breaks a rule is that item's problem, its field named from the body's root
(`items[3].job.spec.queue`), and nothing of it is stored; the other items are stored together,
in as few store transactions as the book's group commit allows (`Jobs.submit_many`), each job
with a trace of its own (linked to the batch's request) and its `job.submit` span, counted as
a single submit is. A key used
again within the batch is decided once the item that used it first is answered, as if the two
had been sent one after the other: the same body replays that job (200), another body is 422
`idempotency-key-reused`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import string
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pydantic
from aiohttp import web
from opentelemetry import trace

from broker.api import arrays, errors, jobs, status, submits
from broker.http import auth, documents, keys, problems
from broker.jobs import service
from broker.state import registry
from broker.telemetry import jobspans, tracing

KEY_HEADER = "Idempotency-Key"
BOUNDS = web.AppKey("expansion_bounds", submits.Bounds)  # what one request may expand to
# items read between two turns of the event loop: a batch of 1,000 takes a few tenths of a
# second to check, which must not hold up heartbeats and the leader's lease renewals
ITEMS_PER_TURN = 100
_ID_CHARS = string.ascii_lowercase + string.digits
_ITEM_FIELDS = frozenset({"job", "idempotencyKey"})
# a job id's random part: drawn from a generator seeded once from the OS (ids must not
# repeat, and a tenant reads only its own jobs whatever their ids), not from `secrets`, a
# system call each
_IDS = random.Random(os.urandom(32))


def new_job_id(name: str, *, length: int = 59) -> str:
    """A new id from a name: at most `length` characters, 8 random ones at the end."""
    head = name[: length - 9].rstrip("-")
    number = _IDS.randrange(len(_ID_CHARS) ** 8)  # one draw, not one per character
    tail = []
    for _ in range(8):
        number, digit = divmod(number, len(_ID_CHARS))
        tail.append(_ID_CHARS[digit])
    return f"{head}-{''.join(tail)}"


# ---- what both routes check and make ----------------------------------------------------------


def admit(
    principal: auth.Principal,
    document: Any,
    *,
    queues: registry.QueueRegistry | None,
    where: str = "",
    bounds: submits.Bounds | None = None,
) -> jobs.GPUJob:
    """The job `document` asks for, held to every rule of a submit and to the queue's, and
    to what one request may expand to (`bounds`, default `api.submits.Bounds`); the refusal
    names its field from `where` on (a batch item's `items[3].job`; "": the body)."""
    if not isinstance(document, dict):
        raise errors.Invalid(
            f"{where or 'the body'} must be a GPUJob object",
            field=where or None,
            title="Invalid job",
        )
    try:
        job = jobs.validate_submitted(document)
    except pydantic.ValidationError as exc:
        raise problems.from_validation(exc, prefix=f"{where}." if where else "") from None
    if queues is not None:
        try:
            queues.check_job(principal.name, job)
        except errors.GpufedError as exc:
            raise problems.relocated(exc, where) from None
    submits.Expansion().check(job, bounds or submits.Bounds(), where=where)
    return job


def bounds_of(app: web.Application) -> submits.Bounds:
    """What one request may expand to on this broker (`BOUNDS`, else the defaults)."""
    return app.get(BOUNDS) or submits.Bounds()


def new_record(
    book: service.Jobs,
    principal: auth.Principal,
    job: jobs.GPUJob,
    *,
    key: str | None,
    job_id: str | None = None,
    own_trace: bool = False,
) -> status.JobRecord:
    """A new job of `principal`'s: in the request's trace, or in one of its own, linked to
    the request (`own_trace`: one of a batch's or an array's jobs)."""
    traceparent, parent = book.new_trace(own=own_trace)
    return status.JobRecord(
        id=job_id or new_job_id(job.metadata.name),
        tenant=principal.name,
        job=job,
        traceparent=traceparent,
        trace_parent=parent,
        trace_id=traceparent.split("-")[1],
        idempotency_key=key,
    )


async def new_records(
    book: service.Jobs,
    principal: auth.Principal,
    job: jobs.GPUJob,
    *,
    key: str | None,
    own_trace: bool = False,
) -> list[status.JobRecord]:
    """The jobs a submit makes: the job, or its array's `count` jobs (`api.arrays`: job `i`
    named `<name>-<i>`, id `<array id>-<i>`, labelled; the key on index 0's), a turn of the
    event loop every `ITEMS_PER_TURN` of them (10,000 take most of a second). A trace each,
    linked to the request, when the request makes many (`own_trace`: a batch; an array
    always); a single job continues the request's trace."""
    spec = job.spec.array
    if spec is None:
        return [new_record(book, principal, job, key=key, own_trace=own_trace)]
    name = job.metadata.name
    array_id = new_job_id(name, length=arrays.MAX_ARRAY_ID)
    out = []
    for index in range(spec.count):
        if index and index % ITEMS_PER_TURN == 0:
            await asyncio.sleep(0)
        labels = {**job.metadata.labels, arrays.ARRAY_LABEL: name, arrays.INDEX_LABEL: str(index)}
        meta = job.metadata.model_copy(
            update={"name": arrays.member_name(name, index), "labels": labels}
        )
        member = job.model_copy(update={"metadata": meta})
        record = new_record(
            book,
            principal,
            member,
            key=key if index == 0 else None,
            job_id=f"{array_id}-{index}",
            own_trace=True,
        )
        record.array = arrays.ArrayMember(
            id=array_id, name=name, index=index, count=spec.count, parallelism=spec.limit
        )
        out.append(record)
    return out


async def resolve(book: service.Jobs, new: Sequence[status.JobRecord]) -> None:
    """Resolve the dependencies of jobs stored together (`jobs.dependents`); Invalid naming
    the field if they close a cycle."""
    refusal = next((r for r in await book.resolve_dependencies(new) if r is not None), None)
    if refusal is not None:
        raise refusal


def _span_attributes(record: status.JobRecord) -> dict[str, str]:
    return {
        "gpufed.job": record.id,
        "gpufed.tenant": record.tenant,
        "gpufed.queue": record.job.spec.queue,
    }


async def submit_one(
    book: service.Jobs,
    principal: auth.Principal,
    job: jobs.GPUJob,
    *,
    key: str | None,
    own_trace: bool = False,
) -> tuple[status.JobRecord, bool]:
    """Store one admitted job (an array: its jobs); returns it (an array's index 0) and
    whether it was replayed (its key's job, the same body: IdempotencyKeyReused if another).
    An array's index 0 is stored first, with the key, then the others together: a replay
    stores none of them again."""
    new = await new_records(book, principal, job, key=key, own_trace=own_trace)
    if key:
        existing = await book.find_idempotent(principal.name, key, new[0].job)
        if existing is not None:
            return existing, True
    await resolve(book, new)
    record = new[0]
    span: AbstractContextManager[object] = contextlib.nullcontext()  # a span dropped: none
    if tracing.records_spans():
        span = jobspans.tracer.start_as_current_span(
            "job.submit",
            context=tracing.context_of(record.traceparent),
            attributes=_span_attributes(record),
        )
    with span:
        stored = await book.submit(record)
    for start in range(1, len(new) if stored is record else 1, submits.MAX_BATCH_ITEMS):
        chunk = new[start : start + submits.MAX_BATCH_ITEMS]  # a batch's worth at a time
        failure = next((r for r in await _store(book, chunk, batch=len(chunk)) if _failed(r)), None)
        if isinstance(failure, Exception):
            raise failure
    return stored, stored is not record


def _failed(result: status.JobRecord | Exception) -> bool:
    return isinstance(result, Exception)


# ---- the batch route ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Repeat:
    """An item whose key an earlier item of the batch uses: decided after that one."""

    index: int
    key: str
    job: jobs.GPUJob


async def submit_batch(request: web.Request) -> web.Response:
    principal = auth.caller(request)  # a tenant's (broker.http.roles)
    if KEY_HEADER in request.headers:
        raise errors.Malformed(
            f"{KEY_HEADER}: not on a batch; each item has its own idempotencyKey",
            field=KEY_HEADER,
            title="Bad Idempotency-Key",
        )
    items = _items_of(await _read_batch(request))
    book = request.app[keys.JOBS]
    queue_registry = request.app.get(keys.QUEUES)
    answers: list[submits.BatchItemAnswer | None] = [None] * len(items)
    admitted: list[tuple[int, list[status.JobRecord]]] = []
    repeats: list[_Repeat] = []
    keyed: set[str] = set()
    bounds = bounds_of(request.app)
    expanded = submits.Expansion()  # what the items read so far make
    for index, item in enumerate(items):
        if index and index % ITEMS_PER_TURN == 0:
            await asyncio.sleep(0)
        try:
            key, job = _read_item(principal, item, index, queues=queue_registry, bounds=bounds)
            expanded = expanded.check(job, bounds, where=f"items[{index}].job")
        except errors.GpufedError as exc:  # anything else: a 500, and nothing stored yet
            answers[index] = _refused(index, exc, status_code=problems.status_of(exc))
            continue
        if key is not None and (key in keyed or job.spec.array is not None):
            # a keyed array is stored as a single submit stores it: a replay stores none
            repeats.append(_Repeat(index, key, job))
            keyed.add(key)
            continue
        if key is not None:
            keyed.add(key)
        admitted.append((index, await new_records(book, principal, job, key=key, own_trace=True)))
    admitted = await _resolve_items(book, admitted, answers)
    results = await _store(book, [r for _, group in admitted for r in group], batch=len(items))
    at = 0
    for index, group in admitted:
        mine = results[at : at + len(group)]
        at += len(group)
        first: status.JobRecord | Exception = next((r for r in mine if _failed(r)), mine[0])
        answers[index] = _answer(index, first, replayed=first is not group[0], request=request)
    for repeat in repeats:
        try:
            stored, replayed = await submit_one(
                book, principal, repeat.job, key=repeat.key, own_trace=True
            )
        except Exception as exc:  # the others are stored: this item's answer, not the batch's
            answers[repeat.index] = _answer(repeat.index, exc, replayed=False, request=request)
        else:
            answers[repeat.index] = _answer(
                repeat.index, stored, replayed=replayed, request=request
            )
    done = [a for a in answers if a is not None]
    answer = submits.BatchAnswer(
        items=done,
        accepted=sum(1 for a in done if a.status == 202),
        replayed=sum(1 for a in done if a.status == 200),
        failed=sum(1 for a in done if a.status >= 400),
    )
    return web.json_response(answer.model_dump(mode="json", by_alias=True, exclude_none=True))


async def _resolve_items(
    book: service.Jobs,
    admitted: list[tuple[int, list[status.JobRecord]]],
    answers: list[submits.BatchItemAnswer | None],
) -> list[tuple[int, list[status.JobRecord]]]:
    """The items' dependencies resolved together (a name may be another item's job); an
    item whose job closes a cycle is refused (its field named from the body's root)."""
    refusals = await book.resolve_dependencies([r for _, group in admitted for r in group])
    kept = []
    at = 0
    for index, group in admitted:
        mine = refusals[at : at + len(group)]
        at += len(group)
        refusal = next((r for r in mine if r is not None), None)
        if refusal is None:
            kept.append((index, group))
            continue
        error = problems.relocated(refusal, f"items[{index}].job")
        answers[index] = _refused(index, error, status_code=problems.status_of(error))
    return kept


async def _read_batch(request: web.Request) -> Any:
    try:  # the app's bound is one job's body (1 MiB); a batch may carry more
        raw = await request.clone(client_max_size=submits.MAX_BATCH_BYTES).read()
    except web.HTTPRequestEntityTooLarge:
        raise errors.TooLarge(
            f"the body is over {submits.MAX_BATCH_BYTES // (1024 * 1024)} MiB: send fewer "
            "jobs per batch",
            title="Body too large",
        ) from None
    return documents.read_document(
        raw, content_type=request.content_type, what="a batch of jobs", checked=False
    )


def _items_of(document: Any) -> list[Any]:
    """The items of a batch body; Invalid naming the field if it is not one."""
    wanted = f"a list of 1 to {submits.MAX_BATCH_ITEMS} items {{idempotencyKey, job}}"
    if not isinstance(document, dict):
        raise errors.Invalid(
            f'the body must be an object {{"items": {wanted}}}', title="Invalid batch"
        )
    for name in document:
        if name != "items":
            raise errors.Invalid(f"{name}: unknown field", field=str(name), title="Invalid batch")
    items = document.get("items")
    if not isinstance(items, list):
        said = "required" if items is None else f"not a {type(items).__name__}"
        raise errors.Invalid(f"items: {said}; {wanted}", field="items", title="Invalid batch")
    if not 1 <= len(items) <= submits.MAX_BATCH_ITEMS:
        raise errors.Invalid(
            f"items: {len(items)} items; {wanted}", field="items", title="Invalid batch"
        )
    return items


def _read_item(
    principal: auth.Principal,
    item: Any,
    index: int,
    *,
    queues: registry.QueueRegistry | None,
    bounds: submits.Bounds,
) -> tuple[str | None, jobs.GPUJob]:
    """The key and the job of one item, held to the single route's checks, in its order:
    the job bounded (`documents.check_tree`, depth counted from the job), admitted, the key."""
    where = f"items[{index}]"
    if not isinstance(item, dict):
        raise errors.Invalid(
            f"{where}: an object {{idempotencyKey, job}}", field=where, title="Invalid job"
        )
    for name in item:
        if name not in _ITEM_FIELDS:
            field = f"{where}.{name}"
            raise errors.Invalid(f"{field}: unknown field", field=field, title="Invalid job")
    if "job" not in item:
        raise errors.Invalid(f"{where}.job: required", field=f"{where}.job", title="Invalid job")
    documents.check_tree(item["job"], path=f"{where}.job")
    job = admit(principal, item["job"], queues=queues, where=f"{where}.job", bounds=bounds)
    field = f"{where}.idempotencyKey"
    key = submits.check_idempotency_key(item.get("idempotencyKey"), field=field)
    documents.check_tree(key, path=field)  # no lone surrogate: the key is hashed as UTF-8
    return key, job


async def _store(
    book: service.Jobs, new: Sequence[status.JobRecord], *, batch: int
) -> list[status.JobRecord | Exception]:
    """Store the admitted jobs together, each in its `job.submit` span."""
    if not new:
        return []
    if not tracing.records_spans():
        return await book.submit_many(new)
    spans = [
        jobspans.tracer.start_span(
            "job.submit",
            context=tracing.context_of(record.traceparent),
            attributes={**_span_attributes(record), "gpufed.batch_items": batch},
        )
        for record in new
    ]
    results: list[status.JobRecord | Exception] = []
    try:
        results = await book.submit_many(new)
    finally:
        for index, span in enumerate(spans):
            result = results[index] if index < len(results) else None
            if isinstance(result, Exception):
                span.record_exception(result)
                span.set_status(trace.StatusCode.ERROR, str(result)[:200])
            span.end()
    return results


def _answer(
    index: int,
    result: status.JobRecord | BaseException,
    *,
    replayed: bool,
    request: web.Request,
) -> submits.BatchItemAnswer:
    """The answer of an item the book was given: its job, or the problem (store faults as
    the single route says them), its field named at the item."""
    if isinstance(result, status.JobRecord):
        return submits.BatchItemAnswer(
            index=index,
            status=200 if replayed else 202,
            id=result.id,
            state=result.status.state,
            trace_id=result.trace_id,
        )
    error, code = problems.problem_of(result, where=f"{request.method} {request.path}")
    item = f"items[{index}]"
    if error.field == KEY_HEADER:  # the key was used for another body: the item's key
        error.field = f"{item}.idempotencyKey"
        error.detail = error.detail.replace(f"{KEY_HEADER}: ", f"{error.field}: ", 1)
    elif isinstance(error, errors.TooLarge):  # the job, as the store would hold it
        error.field = f"{item}.job"
    return _refused(index, error, status_code=code)


def _refused(index: int, error: errors.GpufedError, *, status_code: int) -> submits.BatchItemAnswer:
    return submits.BatchItemAnswer(
        index=index,
        status=status_code,
        problem=problems.body_of(error, f"/v1/jobs:batch#/items/{index}", status=status_code),
    )
