"""What the book keeps of each job it holds: the record's models packed (`kits.packing`), one
`Waiting` for the jobs told alike, the spec's stored JSON with the job and not in a memo."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import pytest

from broker.api import status
from broker.api.queues import ReasonCode
from broker.jobs import book
from broker.planning import plans
from broker.state import records, sqlite
from kits import packing
from tests.builders import make_job


@pytest.fixture
async def job_book() -> AsyncIterator[book.JobBook]:
    backing = await sqlite.SqliteStore.open(":memory:")
    try:
        yield book.JobBook(records.JobStore(backing))
    finally:
        await backing.close()


async def queued(job_book: book.JobBook, job_id: str) -> status.JobRecord:
    record = status.JobRecord(id=job_id, tenant="t", job=make_job("w", gpus=1).build())
    record.record(status.JobState.QUEUED, "Submitted", "accepted by the broker")
    return await job_book.create(record)


async def test_a_held_record_is_packed_and_its_drafts_change_apart(
    job_book: book.JobBook,
) -> None:
    record = await queued(job_book, "w-1")
    own = status.JobStatus.model_validate(record.status.model_dump())  # a dictionary of its own
    assert sys.getsizeof(record.status.__dict__) < sys.getsizeof(own.__dict__) / 2
    assert record.status.pods is packing.EMPTY_LIST
    written = records.encode(record)
    draft = book.draft_of(record)
    draft.status.pods.append(status.PodStatus(name="w-1-worker-0", task="worker", node="n1"))
    draft.record(status.JobState.DISPATCHED, "Dispatched", "to east")
    await job_book.commit([draft], fenced=False)
    assert records.encode(record) == written and record.status.pods == []
    held = job_book.get("w-1")
    assert held is draft and [p.node for p in held.status.pods] == ["n1"]


async def test_jobs_told_the_same_reasons_hold_one_waiting(job_book: book.JobBook) -> None:
    for job_id in ("w-1", "w-2", "w-3"):
        await queued(job_book, job_id)

    def told(job_id: str, message: str) -> None:
        """A cycle's verdict: objects of its own for every job."""
        miss = plans.Unplaceable.of(
            job_id, [plans.Reason("fleet", ReasonCode.NO_CLUSTERS, f"no {message}")]
        )
        job_book.note_waiting(job_id, book.Waiting(miss.reasons, miss.details))

    told("w-1", "cluster")
    told("w-2", "cluster")
    told("w-3", "room")
    first, second, third = (job_book.waiting(j) for j in ("w-1", "w-2", "w-3"))
    assert first is second and first is not None and first.reasons == ("fleet: no cluster",)
    assert third is not None and third.reasons == ("fleet: no room",)


async def test_a_held_jobs_spec_is_written_once_and_kept_with_it(
    job_book: book.JobBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    dumps: list[str] = []
    encode_job = records.encode_job

    def counted(job: object) -> str:
        dumps.append("dump")
        return encode_job(job)  # type: ignore[arg-type]

    monkeypatch.setattr(records, "encode_job", counted)
    record = await queued(job_book, "w-1")
    for state in (status.JobState.DISPATCHED, status.JobState.RUNNING):
        draft = book.draft_of(job_book.get("w-1") or record)
        draft.record(state, state.value, "")
        await job_book.commit([draft], fenced=False)
    assert dumps == ["dump"]  # at submit; the commits wrote what the book kept
    assert records._SPECS.peek(record.job) is None  # kept with the job, not in the memo
    stored = await job_book.store.get("w-1")
    assert stored is not None and stored.record == job_book.get("w-1")
    assert job_book.spec_of("w-1") == encode_job(record.job) and job_book.spec_of("x") is None
