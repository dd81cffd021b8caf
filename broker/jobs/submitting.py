"""New jobs from submits: what a submit stores once its job is admitted, one job or a batch.

`http/` reads a request and admits each job (its rules, its queue, its key's rule, what it
expands to: `http.admitting`); from there the steps are the book's, in this order:

1. mint ids and build the records (`new_records`): the job, or its array's `count` jobs, the
   key on index 0's; a trace each, linked to the request, when a request makes many
2. replay by idempotency key (`Jobs.find_idempotent`): the key's job for the same body,
   IdempotencyKeyReused for another; a replay stores nothing
3. resolve the dependencies of the jobs stored together (`Jobs.resolve_dependencies`): a job
   that would close a cycle is refused, Invalid naming its field
4. store them (`Jobs.submit_many`, the book's group commit), each in its `job.submit` span.

A batch (`submit_batch`) stores its items together, in as few store transactions as the
group commit allows. A key used again within the batch, and a keyed array, is decided after
the others are stored, as if sent one after the other (`submit_one`): the same body replays
that job, another is IdempotencyKeyReused. Each item's outcome is a value (`Submitted`):
the HTTP layer names the fields of its refusal from the body's root.
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

from opentelemetry import trace

from broker.api import arrays, jobs, status, submits
from broker.jobs import service
from broker.telemetry import jobspans, tracing

# jobs made between two turns of the event loop: an array of 10,000 takes most of a second,
# a batch of 1,000 a few tenths, which must not hold up heartbeats and lease renewals
ITEMS_PER_TURN = 100
_ID_CHARS = string.ascii_lowercase + string.digits
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


# ---- 1. ids and records ---------------------------------------------------------------------


def new_record(
    book: service.Jobs,
    tenant: str,
    job: jobs.GPUJob,
    *,
    key: str | None,
    job_id: str | None = None,
    own_trace: bool = False,
) -> status.JobRecord:
    """A new job of `tenant`'s: in the request's trace, or in one of its own, linked to the
    request (`own_trace`: one of a batch's or an array's jobs)."""
    traceparent, parent = book.new_trace(own=own_trace)
    return status.JobRecord(
        id=job_id or new_job_id(job.metadata.name),
        tenant=tenant,
        job=job,
        traceparent=traceparent,
        trace_parent=parent,
        trace_id=traceparent.split("-")[1],
        idempotency_key=key,
    )


async def new_records(
    book: service.Jobs,
    tenant: str,
    job: jobs.GPUJob,
    *,
    key: str | None,
    own_trace: bool = False,
) -> list[status.JobRecord]:
    """The jobs a submit makes: the job, or its array's `count` jobs (`api.arrays`: job `i`
    named `<name>-<i>`, id `<array id>-<i>`, labelled; the key on index 0's), a turn of the
    event loop every `ITEMS_PER_TURN` of them. A trace each, linked to the request, when the
    request makes many (`own_trace`: a batch; an array always); a single job continues the
    request's trace."""
    spec = job.spec.array
    if spec is None:
        return [new_record(book, tenant, job, key=key, own_trace=own_trace)]
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
            tenant,
            member,
            key=key if index == 0 else None,
            job_id=arrays.member_id(array_id, index),
            own_trace=True,
        )
        record.array = arrays.ArrayMember(
            id=array_id, name=name, index=index, count=spec.count, parallelism=spec.limit
        )
        out.append(record)
    return out


# ---- one submit -----------------------------------------------------------------------------


async def submit_one(
    book: service.Jobs,
    tenant: str,
    job: jobs.GPUJob,
    *,
    key: str | None,
    own_trace: bool = False,
) -> tuple[status.JobRecord, bool]:
    """Store one admitted job (an array: its jobs); returns it (an array's index 0) and
    whether it was replayed (its key's job, the same body: IdempotencyKeyReused if another).
    An array's index 0 is stored first, with the key, then the others together, a batch's
    worth at a time: a replay stores none of them again."""
    # 1. ids and records
    new = await new_records(book, tenant, job, key=key, own_trace=own_trace)
    # 2. replay
    if key:
        existing = await book.find_idempotent(tenant, key, new[0].job)
        if existing is not None:
            return existing, True
    # 3. dependencies
    refusal = next((r for r in await book.resolve_dependencies(new) if r is not None), None)
    if refusal is not None:
        raise refusal
    # 4. store: the first (the key's), then the rest of an array
    record = new[0]
    span: AbstractContextManager[object] = contextlib.nullcontext()  # a span dropped: none
    if tracing.records_trace(record.traceparent):
        span = jobspans.tracer.start_as_current_span(
            "job.submit",
            context=tracing.context_of(record.traceparent),
            attributes=_span_attributes(record),
        )
    with span:
        stored = await book.submit(record)
    for start in range(1, len(new) if stored is record else 1, submits.MAX_BATCH_ITEMS):
        chunk = new[start : start + submits.MAX_BATCH_ITEMS]
        failure = next((r for r in await store(book, chunk, batch=len(chunk)) if _failed(r)), None)
        if isinstance(failure, Exception):
            raise failure
    return stored, stored is not record


# ---- a batch --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """A batch's item, admitted: its place in the request, its key and its job."""

    index: int
    key: str | None
    job: jobs.GPUJob


@dataclass(frozen=True)
class Submitted:
    """What became of an item: its job (stored, or replayed) or what refused it.
    `unresolved`: refused by its dependencies (a cycle), the refusal's field the job's."""

    index: int
    result: status.JobRecord | Exception
    replayed: bool = False
    unresolved: bool = False


async def submit_batch(
    book: service.Jobs, tenant: str, items: Sequence[Item], *, batch: int
) -> list[Submitted]:
    """Store a batch's admitted items together; one outcome per item, in `items`' order.
    An item whose key an earlier item uses, and a keyed array, is submitted on its own after
    the others (`submit_one`), as if sent after them. `batch`: the request's items, each
    span's `gpufed.batch_items`."""
    outcomes: dict[int, Submitted] = {}
    together: list[tuple[int, list[status.JobRecord]]] = []
    later: list[Item] = []
    keyed: set[str] = set()
    # 1. ids and records; 2. replays ordered: a key's second use waits for its first
    for at, item in enumerate(items):
        if at and at % ITEMS_PER_TURN == 0:
            await asyncio.sleep(0)
        if item.key is not None and (item.key in keyed or item.job.spec.array is not None):
            # a keyed array is stored as a single submit stores it: a replay stores none
            later.append(item)
            keyed.add(item.key)
            continue
        if item.key is not None:
            keyed.add(item.key)
        group = await new_records(book, tenant, item.job, key=item.key, own_trace=True)
        together.append((item.index, group))
    # 3. dependencies, resolved together (a name may be another item's job)
    refusals = await book.resolve_dependencies([r for _, group in together for r in group])
    kept = []
    at = 0
    for index, group in together:
        theirs = refusals[at : at + len(group)]
        at += len(group)
        refusal = next((r for r in theirs if r is not None), None)
        if refusal is None:
            kept.append((index, group))
        else:
            outcomes[index] = Submitted(index, refusal, unresolved=True)
    # 4. store them together; then the items that waited, one by one
    results = await store(book, [r for _, group in kept for r in group], batch=batch)
    at = 0
    for index, group in kept:
        mine = results[at : at + len(group)]
        at += len(group)
        first: status.JobRecord | Exception = next((r for r in mine if _failed(r)), mine[0])
        outcomes[index] = Submitted(index, first, replayed=first is not group[0])
    for item in later:
        try:
            stored, replayed = await submit_one(
                book, tenant, item.job, key=item.key, own_trace=True
            )
        except Exception as exc:  # the others are stored: this item's outcome, not the batch's
            outcomes[item.index] = Submitted(item.index, exc)
        else:
            outcomes[item.index] = Submitted(item.index, stored, replayed=replayed)
    return [outcomes[item.index] for item in items]


async def store(
    book: service.Jobs, new: Sequence[status.JobRecord], *, batch: int
) -> list[status.JobRecord | Exception]:
    """Store new jobs together (`Jobs.submit_many`), each in its `job.submit` span."""
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
        if tracing.records_trace(record.traceparent)
        else None  # a trace not sampled
        for record in new
    ]
    results: list[status.JobRecord | Exception] = []
    try:
        results = await book.submit_many(new)
    finally:
        for index, span in enumerate(spans):
            if span is None:
                continue
            result = results[index] if index < len(results) else None
            if isinstance(result, Exception):
                span.record_exception(result)
                span.set_status(trace.StatusCode.ERROR, str(result)[:200])
            span.end()
    return results


def _span_attributes(record: status.JobRecord) -> dict[str, str]:
    return {
        "gpufed.job": record.id,
        "gpufed.tenant": record.tenant,
        "gpufed.queue": record.job.spec.queue,
    }


def _failed(result: status.JobRecord | Exception) -> bool:
    return isinstance(result, Exception)
