"""Two writers let the book's lock go for the store's round trip: the group commit
(`JobBook.flush(locked=False)`, the flusher's) and the dispatch (`JobBook.launch`, `land`).
Their round trip holds up no collaborator, and a job one of them is writing is still written
in order. On a real SQLite store, its writes held at the gate on purpose."""

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
        self.fail_next = False  # a store error: the write's outcome unknown, nothing read again
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
            if self.fail_next:
                self.fail_next = False
                raise errors.TemporaryStoreError("injected: the store timed out")
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
    queued = status.JobRecord(id="c", tenant="team-a", job=make_job("c").build())
    queued.record(State.QUEUED, "Submitted")
    await made.create(queued)
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


async def commit_running(made: book.JobBook, job_id: str) -> None:
    """A collaborator's commit (under the lock, at once) that the job runs: within 2 s, or
    the test fails (held up by a write in flight of other jobs)."""
    async with asyncio.timeout(2), made.lock:
        draft = made.draft(job_id)
        assert draft is not None
        draft.record(State.RUNNING, "Running")
        await made.commit([draft])


async def cancel_behind(made: book.JobBook, gate: Gate, job_id: str, state: State) -> None:
    """A cancel of the job, drafted (under the lock) on what `latest` shows while a write of
    it waits at the closed gate (in `state`): its commit waits, not sent, until the gate
    opens; then it is written after that write."""
    sent = len(gate.updates)
    async with made.lock:
        draft = made.draft(job_id)
        assert draft is not None and draft.status.state == state
        draft.status.cancel_requested = True
        committing = asyncio.create_task(made.commit([draft], fenced=False))
        await asyncio.sleep(0.05)
        assert not committing.done() and len(gate.updates) == sent  # it waits: not sent
        gate.open.set()
        await committing


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
    await commit_running(made, "b")  # while the group commit's round trip lasts
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
    await cancel_behind(made, gate, "a", State.RUNNING)  # drafted from the report in flight
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


async def held_launch(
    made: book.JobBook, gate: Gate
) -> tuple[status.JobRecord, asyncio.Task[None]]:
    """Job c dispatched as the scheduler does (drafted under the lock, written without it),
    its write held at the closed gate."""
    gate.hold = {"c"}
    gate.open.clear()
    async with made.lock:
        assert made.settled("c")
        draft = made.draft("c")
        assert draft is not None
        draft.status.cluster = "east"
        draft.record(State.DISPATCHED, "Dispatched")
        launch = made.launch([draft])
    landing = asyncio.create_task(made.land(launch))
    await gate.held()
    return draft, landing


async def test_a_dispatch_in_flight_holds_up_no_report_of_another_job(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    made, gate = jobs
    dispatched, landing = await held_launch(made, gate)
    assert not made.settled("c") and made.latest("c") is dispatched
    got = made.get("c")
    assert got is not None and got.status.state == State.QUEUED  # not landed: not shown
    await commit_running(made, "a")  # while the dispatch's round trip lasts
    assert not landing.done()
    gate.open.set()
    await landing
    assert made.get("c") is dispatched and made.settled("c")
    got = made.get("a")
    assert got is not None and got.status.state == State.RUNNING


async def test_a_cancel_drafted_while_its_dispatch_is_in_flight_builds_on_it(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    made, gate = jobs
    _, landing = await held_launch(made, gate)
    # what `latest` shows: the dispatch being written
    await cancel_behind(made, gate, "c", State.DISPATCHED)
    await landing
    got = made.get("c")
    assert got is not None and got.status.cancel_requested
    assert got.status.state == State.DISPATCHED and got.status.cluster == "east"
    assert gate.updates[-2:] == [["c"], ["c"]]  # the dispatch, then the cancel


async def test_what_was_drafted_on_a_dispatch_that_did_not_land_does_not_land(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    """The dispatch loses a race while a cancel drafted on it waits (holding the lock): the
    cancel is refused, not written over the record as if the job had been dispatched; drafted
    again, it cancels the queued job."""
    made, gate = jobs
    gate.conflict_next = True
    _, landing = await held_launch(made, gate)
    async with asyncio.timeout(2), made.lock:
        draft = made.draft("c")
        assert draft is not None and draft.status.state == State.DISPATCHED
        draft.status.cancel_requested = True
        committing = asyncio.create_task(made.commit([draft], fenced=False))
        await asyncio.sleep(0.01)
        gate.open.set()
        with pytest.raises(errors.ConflictError, match="did not land"):
            await committing
        again = made.draft("c")
        assert again is not None and again.status.state == State.QUEUED
        again.record(State.CANCELLED, "Cancelled")
        await made.commit([again], fenced=False)
    with pytest.raises(errors.ConflictError):
        await landing
    got = made.get("c")
    assert got is not None and got.status.state == State.CANCELLED
    assert [e.state for e in got.status.events] == [State.QUEUED, State.CANCELLED]
    assert made.settled("c") and made.latest("c") is got


async def test_a_report_drafted_on_a_dispatch_that_did_not_land_is_dropped(
    jobs: tuple[book.JobBook, Gate],
) -> None:
    """After a store error (nothing read again), a report drafted on the dispatch that waits
    for the group commit is not written: the job is queued, as the store has it."""
    made, gate = jobs
    gate.fail_next = True
    _, landing = await held_launch(made, gate)
    async with made.lock:
        report(made, "c", State.RUNNING)  # waits for the group commit, built on the dispatch
    gate.open.set()
    with pytest.raises(errors.TemporaryStoreError):
        await landing
    assert made.pending_writes == 1
    with pytest.raises(errors.ConflictError, match="did not land"):
        await made.flush(locked=False)
    got = made.get("c")
    assert got is not None and got.status.state == State.QUEUED and made.pending_writes == 0
