"""What a submit must pass, one job or a batch: the checks both routes make, and the batch
route. What is stored, and how, is the book's (`jobs.submitting`).

`POST /v1/jobs` (`http/jobs.submit`) and `POST /v1/jobs:batch` (`submit_batch`, here) hold
every job to the same checks through the same functions: a tenant's token, the job's rules
(`admit`: `api.jobs.validate_submitted`, then the queue, `state.registry.check_job`), the
key's rule (`api.submits.check_idempotency_key`). Both hand the admitted job to
`jobs.submitting` (ids, records, an array's jobs, replays, dependencies, the store).

Both hold a request to what it expands to (`api.submits.Bounds`: jobs, their bytes and their
`dependsOn` entries, arrays counted whole; `BOUNDS`, set from the broker's flags): a single
submit past one is 422 naming the field and the bound, a batch's item past one is that
item's 422 and the items before it are stored.

A batch answers one status per item, in request order (`api.submits.BatchAnswer`). A body
that is not a batch (not JSON or YAML, over `MAX_BATCH_BYTES`, no `items`, none or over
`MAX_BATCH_ITEMS` of them) is one problem, and nothing is stored. Past that, an item that
breaks a rule is that item's problem, its field named from the body's root
(`items[3].job.spec.queue`), and nothing of it is stored; the other items are stored together
(`jobs.submitting.submit_batch`), each job with a trace of its own (linked to the batch's
request) and its `job.submit` span, counted as a single submit is. A key used again within
the batch is decided once the item that used it first is answered, as if the two had been
sent one after the other: the same body replays that job (200), another body is 422
`idempotency-key-reused`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
from aiohttp import web

from broker.api import errors, jobs, status, submits
from broker.http import auth, documents, keys, problems
from broker.jobs import submitting
from broker.state import registry

KEY_HEADER = "Idempotency-Key"
BOUNDS = web.AppKey("expansion_bounds", submits.Bounds)  # what one request may expand to
_ITEM_FIELDS = frozenset({"job", "idempotencyKey"})


# ---- what both routes check -----------------------------------------------------------------


def admit(
    principal: auth.Principal,
    document: Any,
    *,
    queues: registry.QueueRegistry | None,
    bounds: submits.Bounds,
    interning: jobs.Interning | None = None,
    where: str = "",
) -> jobs.GPUJob:
    """The job `document` asks for, held to every rule of a submit and to the queue's, and
    to what one request may expand to (`bounds`); the refusal names its field from `where`
    on (a batch item's `items[3].job`; "": the body). `interning`: where the book keeps one
    object per kind of template and shape."""
    if not isinstance(document, dict):
        raise errors.Invalid(
            f"{where or 'the body'} must be a GPUJob object",
            field=where or None,
            title="Invalid job",
        )
    try:
        job = jobs.validate_submitted(document, interning=interning)
    except pydantic.ValidationError as exc:
        raise problems.from_validation(exc, prefix=f"{where}." if where else "") from None
    if queues is not None:
        try:
            queues.check_job(principal.name, job)
        except errors.GpufedError as exc:
            raise problems.relocated(exc, where) from None
    submits.Expansion().check(job, bounds, where=where)
    return job


# ---- the batch route ------------------------------------------------------------------------


async def submit_batch(request: web.Request) -> web.Response:
    principal = auth.caller(request)  # a tenant's (broker.http.roles)
    if KEY_HEADER in request.headers:
        raise errors.Malformed(
            f"{KEY_HEADER}: not on a batch; each item has its own idempotencyKey",
            field=KEY_HEADER,
            title="Bad Idempotency-Key",
        )
    items = _items_of(await _read_batch(request))
    queue_registry = request.app.get(keys.QUEUES)
    answers: list[submits.BatchItemAnswer | None] = [None] * len(items)
    admitted: list[submitting.Item] = []
    bounds = request.app[BOUNDS]
    book = request.app[keys.JOBS]
    expanded = submits.Expansion()  # what the items read so far make
    for index, item in enumerate(items):
        if index and index % submitting.ITEMS_PER_TURN == 0:
            await asyncio.sleep(0)
        try:
            key, job = _read_item(
                principal,
                item,
                index,
                queues=queue_registry,
                bounds=bounds,
                interning=book.book.store.interning,
            )
            expanded = expanded.check(job, bounds, where=f"items[{index}].job")
        except errors.GpufedError as exc:  # anything else: a 500, and nothing stored yet
            answers[index] = _refused(index, exc, status_code=problems.status_of(exc))
            continue
        admitted.append(submitting.Item(index, key, job))
    for outcome in await submitting.submit_batch(book, principal.name, admitted, batch=len(items)):
        answers[outcome.index] = _answer(outcome, request=request)
    done = [a for a in answers if a is not None]
    answer = submits.BatchAnswer(
        items=done,
        accepted=sum(1 for a in done if a.status == 202),
        replayed=sum(1 for a in done if a.status == 200),
        failed=sum(1 for a in done if a.status >= 400),
    )
    return web.json_response(answer.model_dump(mode="json", by_alias=True, exclude_none=True))


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
    interning: jobs.Interning,
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
    job = admit(
        principal,
        item["job"],
        queues=queues,
        bounds=bounds,
        interning=interning,
        where=f"{where}.job",
    )
    field = f"{where}.idempotencyKey"
    key = submits.check_idempotency_key(item.get("idempotencyKey"), field=field)
    documents.check_tree(key, path=field)  # no lone surrogate: the key is hashed as UTF-8
    return key, job


def _answer(outcome: submitting.Submitted, *, request: web.Request) -> submits.BatchItemAnswer:
    """The answer of an item the book was given: its job, or the problem (store faults as
    the single route says them), its field named at the item (a dependency cycle's from the
    item's job on)."""
    index, result = outcome.index, outcome.result
    if isinstance(result, status.JobRecord):
        return submits.BatchItemAnswer(
            index=index,
            status=200 if outcome.replayed else 202,
            id=result.id,
            state=result.status.state,
            trace_id=result.trace_id,
        )
    item = f"items[{index}]"
    if outcome.unresolved and isinstance(result, errors.GpufedError):
        error = problems.relocated(result, f"{item}.job")
        return _refused(index, error, status_code=problems.status_of(error))
    error, code = problems.problem_of(result, where=f"{request.method} {request.path}")
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
