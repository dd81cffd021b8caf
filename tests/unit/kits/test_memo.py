"""memo.PerObject and its users: a job's gang read once, a job's spec written once and read
once by a replica that follows it."""

from __future__ import annotations

import gc
import json

import pytest

from broker.api import gangs, status
from broker.jobs import book
from broker.state import records, sqlite
from kits import memo
from tests.builders import make_job


class Thing:
    def __init__(self, value: int) -> None:
        self.value = value


def test_a_value_is_computed_once_per_object_and_goes_with_it() -> None:
    values: memo.PerObject[Thing, int] = memo.PerObject()
    computed: list[int] = []

    def compute(thing: Thing) -> int:
        computed.append(thing.value)
        return thing.value * 10

    first, twin = Thing(1), Thing(1)
    assert (values.get(first, compute), values.get(first, compute)) == (10, 10)
    assert values.get(twin, compute) == 10  # equal, not the same: its own
    assert computed == [1, 1] and len(values) == 2
    del first
    gc.collect()
    assert len(values) == 1


async def test_the_book_reads_a_held_jobs_gang_once_for_its_job_object() -> None:
    backing = await sqlite.SqliteStore.open(":memory:")
    try:
        job_book = book.JobBook(records.JobStore(backing))
        job = make_job("g", gpus=2).build()
        record = await job_book.create(status.JobRecord(id="g-1", tenant="t", job=job))
        request = job_book.gang(record)
        assert job_book.gang(record) is request
        assert job_book.gang(book.draft_of(record)) is request  # a draft shares the spec
        assert request == gangs.gang_request("g-1", job)  # what reading it again gives
        draft = book.draft_of(record)
        draft.record(status.JobState.QUEUED, "Requeued")
        await job_book.commit([draft], fenced=False)
        assert job_book.gang(draft) is request  # kept while its records share the job
        other = job_book.gang(status.JobRecord(id="g-2", tenant="t", job=job))  # not held
        assert other.job_id == "g-2" and other.tasks is request.tasks
        copied = job.model_copy()
        assert job_book.gang(draft.model_copy(update={"job": copied})) is not request
    finally:
        await backing.close()


def test_a_gang_names_its_pods_per_attempt() -> None:
    job = make_job("g", gpus=2).build()
    again = gangs.gang_request("g-1", job, attempt=2)
    assert again.attempt == 2
    assert [pod for pod, _, _ in again.pod_names()] == ["g-1-worker-0-a2"]


def test_a_record_written_with_its_spec_known_is_what_it_was_written_as_before() -> None:
    """The spec's JSON, written once, and the rest written every time: the same document as
    one dump of the whole record, after the status changed too."""
    record = status.JobRecord(id="w-1", tenant="t", job=make_job("w", gpus=1).build())
    record.record(status.JobState.QUEUED, "Submitted", "accepted by the broker")
    first = records.encode(record)
    draft = book.draft_of(record)  # shares the spec object
    draft.record(status.JobState.DISPATCHED, "Dispatched", "to east")
    draft.status.cluster = "east"
    for written in (first, records.encode(draft)):
        assert written.startswith(b"{")
    whole = draft.model_dump_json(by_alias=True, exclude_defaults=True)
    assert json.loads(records.encode(draft)) == json.loads(whole)
    assert records.decode_record(records.job_key("w-1"), records.encode(draft)) == draft
    assert [e["reason"] for e in json.loads(first)["status"]["events"]] == ["Submitted"]


def queued_and_dispatched() -> tuple[status.JobRecord, status.JobRecord]:
    record = status.JobRecord(id="w-1", tenant="t", job=make_job("w", gpus=1).build())
    record.record(status.JobState.QUEUED, "Submitted", "accepted by the broker")
    draft = book.draft_of(record)
    draft.record(status.JobState.DISPATCHED, "Dispatched", "to east")
    draft.status.cluster = "east"
    return record, draft


def test_a_change_read_by_a_replica_that_holds_the_job_shares_its_spec() -> None:
    """A follower reads each of a job's changes from the store: the spec, the same bytes each
    time, is taken from the record it holds, and the record read is the one written."""
    record, draft = queued_and_dispatched()
    key = records.job_key("w-1")
    held = records.decode_record(key, records.encode(record))  # as a follower first read it
    read = records.decode_record(key, records.encode(draft), known=held)
    assert read.job is held.job
    assert read == draft == records.decode_record(key, records.encode(draft))
    assert read.status.state == status.JobState.DISPATCHED and read.status.cluster == "east"


def test_a_change_with_another_spec_or_format_is_read_whole() -> None:
    record, draft = queued_and_dispatched()
    key = records.job_key("w-1")
    other = status.JobRecord(id="w-1", tenant="t", job=make_job("w", gpus=2).build())
    read = records.decode_record(key, records.encode(draft), known=other)
    assert read.job is not other.job and read == draft
    assert read.job.spec.tasks[0].template.shape == draft.job.spec.tasks[0].template.shape
    # a writer that put the spec elsewhere in the document (a whole dump: "job" not last)
    whole = draft.model_dump_json(by_alias=True, exclude_defaults=True).encode()
    assert list(json.loads(whole))[-1] != "job"
    read = records.decode_record(key, whole, known=record)
    assert read.job is not record.job and read == draft


def test_a_record_without_its_job_is_refused_unless_the_reader_has_it() -> None:
    _, draft = queued_and_dispatched()
    data = json.loads(records.encode(draft))
    data["job"] = None
    headless = json.dumps(data).encode()
    with pytest.raises(ValueError, match="job"):
        records.decode_record(records.job_key("w-1"), headless)
