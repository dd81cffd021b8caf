"""The group commit writes without the book's lock (`JobBook.flush(locked=False)`, the
flusher's): its store round trip holds up no collaborator, and a job it is writing is still
written in order. On a real SQLite store, its writes held at the gate on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.api import status
from broker.jobs import book
from broker.state import errors, records, sqlite
from tests.builders import make_job

State = status.JobState


class Gate:
    """The store's updates of the jobs in `hold` wait at the gate while it is closed (a slow
    round trip); every update's jobs are kept, in order."""

    def __init__(self, job_store: records.JobStore) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.hold = {"a"}
        self.waiting = 0
        self.updates: list[list[str]] = []
        self.conflict_next = False
        update = job_store.update

        async def gated(changes: Any, **kwargs: Any) -> int:
            ids = [item.record.id for item, _ in changes]
            self.updates.append(ids)
            if not self.open.is_set() and self.hold & set(ids):
                self.waiting += 1
                await self.open.wait()
                self.waiting -= 1
            if self.conflict_next:
                self.conflict_next = False
                raise errors.ConflictError("injected: another writer won")
            return await update(changes, **kwargs)

        job_store.update = gated  # type: ignore[method-assign]

    async def held(self) -> None:
        """Until an update waits at the closed gate."""
        async with asyncio.timeout(5):
            while not self.waiting:
                await asyncio.sleep(0.005)


@pytest.fixture
async def jobs() -> AsyncIterator[tuple[book.JobBook, Gate]]:
    backing = await sqlite.SqliteStore.open(":memory:")
    job_store = records.JobStore(backing)
    made = book.JobBook(job_store)
    gate = Gate(job_store)
    for name in ("a", "b"):
        record = status.JobRecord(id=name, tenant="team-a", job=make_job(name).build())
        record.record(State.QUEUED, "Submitted")
        await made.create(record)
        draft = made.draft(name)
        assert draft is not None
        draft.record(State.DISPATCHED, "Dispatched")
        draft.status.cluster = "east"
        await made.commit([draft])
    try:
        yield made, gate
    finally:
        await backing.close()


async def held_flush(
    made: book.JobBook, gate: Gate, *, running: str | None = None
) -> asyncio.Task[None]:
    """The flusher's group commit (without the lock), held at the closed gate; with job
    `running`'s report that it runs given to it first."""
    if running is not None:
        report(made, running, State.RUNNING)
    gate.open.clear()
    flushing = asyncio.create_task(made.flush(locked=False))
    await gate.held()
    return flushing


def report(jobs: book.JobBook, job_id: str, state: State) -> status.JobRecord:
    draft = jobs.draft(job_id)
    assert draft is not None
    draft.record(state, state.value)
    jobs.commit_soon(draft)
    return draft


async def test_a_collaborator_commits_while_the_group_commit_waits_on_the_store(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    made, gate = jobs
    flushing = await held_flush(made, gate, running="a")
    async with asyncio.timeout(2), made.lock:  # while the group commit's round trip lasts
        draft = made.draft("b")
        assert draft is not None
        draft.record(State.RUNNING, "Running")
        await made.commit([draft])
    assert not flushing.done()
    gate.open.set()
    await flushing
    states = [made.get(job_id) for job_id in "ab"]
    assert [r.status.state if r else None for r in states] == [State.RUNNING, State.RUNNING]


async def test_a_report_while_its_job_is_being_written_waits_for_the_next_flush(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    made, gate = jobs
    first = report(made, "a", State.RUNNING)
    acked: list[str] = []
    made.after_commit("a", lambda: acked.append("running"))
    flushing = await held_flush(made, gate)
    async with made.lock:  # an agent's next report: it builds on the one in flight
        assert made.latest("a") is first
        second = report(made, "a", State.SUCCEEDED)
        made.after_commit("a", lambda: acked.append("succeeded"))
    gate.open.set()
    await flushing
    got = made.get("a")
    assert got is not None and got.status.state == State.RUNNING
    assert made.latest("a") is second
    assert acked == []  # both wait for the write that has them both
    await made.flush(locked=False)
    got = made.get("a")
    assert got is not None and got.status.state == State.SUCCEEDED
    assert [e.state for e in got.status.events][-2:] == [State.RUNNING, State.SUCCEEDED]
    assert acked == ["running", "succeeded"]
    assert made.pending_writes == 0


async def test_a_commit_of_a_job_in_flight_waits_and_builds_on_it(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    made, gate = jobs
    flushing = await held_flush(made, gate, running="a")
    sent = len(gate.updates)
    async with made.lock:
        draft = made.draft("a")  # a cancel, drafted from the report in flight
        assert draft is not None
        draft.status.cancel_requested = True
        committing = asyncio.create_task(made.commit([draft]))
        await asyncio.sleep(0.05)
        assert not committing.done() and len(gate.updates) == sent  # it waits: not sent
        gate.open.set()
        await committing
    await flushing
    got = made.get("a")
    assert got is not None and got.status.cancel_requested
    assert got.status.state == State.RUNNING and made.pending_writes == 0
    assert gate.updates[-2:] == [["a"], ["a"]]  # the report, then the cancel


async def test_a_conflicting_group_commit_reads_again_only_once_the_lock_is_free(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    """The group commit loses a race; a collaborator holding the lock drafted the job before:
    its compare-and-swap must fail against the other writer's record, not pass once the
    record is read again."""
    made, gate = jobs
    gate.conflict_next = True
    flushing = await held_flush(made, gate, running="a")
    async with made.lock:
        draft = made.draft("b")
        assert draft is not None
        gate.open.set()
        await asyncio.sleep(0.05)  # the flush conflicted, and waits for the lock to read again
        assert not flushing.done()
        assert made.latest("a") is not None
    with pytest.raises(errors.ConflictError):
        await flushing
    got = made.get("a")
    assert got is not None and got.status.state == State.DISPATCHED  # read again: unchanged
    assert made.pending_writes == 0
