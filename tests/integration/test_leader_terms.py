"""The leader's work across terms (`dispatch.leading.LeaderWork`), with the real job
collaborators on an in-memory SQLite store and a leadership the test hands out and takes
back. A term's task that had ended with an error (the retirer ends itself with
NotLeaderError when a fenced write finds the term over) once ended the leader's work for
good at the end of that term: the replica then led again without working, refusing every
agent with 409 and naming itself as the leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from broker.dispatch import connecting, leading
from broker.jobs import fleet, scheduling, service
from broker.state import electing, errors, records, sqlite, store
from broker.telemetry import metrics


class HandedLeadership:
    """A Leadership (the protocol `state.electing` defines) whose terms the test begins and
    ends; no fence (one replica)."""

    replica = "r0"
    url = None
    replicated = False

    def __init__(self) -> None:
        self.leading = asyncio.Event()
        self.following = asyncio.Event()
        self.following.set()
        self._term = 0

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()

    @property
    def term(self) -> int:
        return self._term

    @property
    def leader_url(self) -> str | None:
        return None

    def fence(self) -> store.Compare | None:
        return None

    def lost_fence(self, exc: errors.ConflictError) -> bool:
        return False

    def on_change(self, callback: Callable[[], None]) -> None:
        pass

    async def run(self) -> None:
        return None

    async def resign(self) -> None:
        return None

    def begin(self) -> None:
        self._term += 1
        self.following.clear()
        self.leading.set()

    def end(self) -> None:
        self.leading.clear()
        self.following.set()


@pytest.fixture
async def work() -> AsyncIterator[tuple[leading.LeaderWork, HandedLeadership, service.Jobs]]:
    backing = await sqlite.SqliteStore.open(":memory:")
    job_store = records.JobStore(backing)
    clusters = fleet.Fleet()
    meters = metrics.BrokerMetrics()
    jobs = service.Jobs(job_store, clusters, meters=meters)
    leadership = HandedLeadership()
    check: electing.Leadership = leadership  # it satisfies the protocol
    del check
    sessions = connecting.Sessions(jobs.reports, clusters, job_store=job_store, meters=meters)

    def make_scheduler() -> scheduling.Scheduler:
        return scheduling.Scheduler(
            jobs.book,
            clusters,
            dispatcher=jobs.dispatcher,
            accounts=jobs.accounts,
            victims=jobs.victims,
            meters=meters,
        )

    out = leading.LeaderWork(
        leadership,
        jobs=jobs,
        sessions=sessions,
        backing=backing,
        meters=meters,
        make_scheduler=make_scheduler,
    )
    try:
        yield out, leadership, jobs
    finally:
        await jobs.close()
        await backing.close()


async def until(condition: Callable[[], bool], *, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_task_that_ended_with_the_term_does_not_end_the_leaders_work(
    work: tuple[leading.LeaderWork, HandedLeadership, service.Jobs],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leader_work, leadership, jobs = work

    async def deposed() -> None:  # as the retirer does when its fenced write fails
        raise errors.NotLeaderError("replica r0 is not the leader")

    monkeypatch.setattr(jobs, "run_key_sweeper", deposed)
    running = asyncio.create_task(leader_work.run())
    try:
        for term in (1, 2, 3):
            leadership.begin()
            await until(lambda: leader_work.active)
            assert leader_work.terms == term
            await asyncio.sleep(0.05)  # the sweeper has ended with its error by now
            leadership.end()
            await until(lambda: not leader_work.active)
            await asyncio.sleep(0.05)
            assert not running.done(), running
    finally:
        await scheduling.stop_task(running)
