"""The scheduler under a deep backlog whose agents' offer windows are full: a cycle plans no
more jobs than it could send offers for (and a slack), and a wakeup while every window is
full runs no cycle until an answer frees a slot or `max_interval` passes. Before, most
cycles of a 20,000-job soak's burst planned 500 jobs to send a few offers, or none.

A real job book on SQLite, the scheduler's loop as a task, the agent a link that records
what it is sent; answers go through `AgentReports`, as a session hands them over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from broker.api import messages, status
from broker.jobs import fleet, scheduling, service
from broker.state import records, sqlite
from broker.telemetry import metrics
from tests import fakes
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
WINDOW = 2


@dataclass
class Broker:
    jobs: service.Jobs
    scheduler: scheduling.Scheduler
    clusters: fleet.Fleet
    link: fakes.RecordingLink
    seq: int = 1

    def summary(self) -> None:
        """The agent's next summary: 40 nodes with all 8 GPUs free (room for every job)."""
        self.seq += 1
        model = make_model_summary(H100, nodes_by_free=[0] * 8 + [40])
        summary = make_summary("east", model, seq=self.seq)
        self.clusters.clusters["east"].apply_summary(messages.Summary(summary=summary, full=True))
        self.clusters.changed.set()

    async def submit(self, count: int, *, start: int = 0) -> None:
        for n in range(start, start + count):
            job = make_job(f"j{n}", gpus=1).model(H100).build()
            await self.jobs.submit(status.JobRecord(id=f"j{n}", tenant="team-a", job=job))

    async def accept(self, offer: messages.Offer) -> None:
        """The agent accepts `offer`: a slot of its window is free again."""
        answer = messages.Accepted(job_id=offer.job_id, epoch=offer.epoch, pods=[])
        await self.jobs.reports.accepted(self.clusters.clusters["east"], answer)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    store = await sqlite.SqliteStore.open(":memory:")
    clusters = fleet.Fleet(max_offers_in_flight=WINDOW)
    meters = metrics.BrokerMetrics()
    jobs = service.Jobs(records.JobStore(store), clusters, meters=meters)
    scheduler = scheduling.Scheduler(
        jobs.book,
        clusters,
        dispatcher=jobs.dispatcher,
        accounts=jobs.accounts,
        victims=jobs.victims,
        meters=meters,
        max_interval=5.0,
    )
    link = fakes.RecordingLink()
    await clusters.attach("east", link, epoch=1)
    made = Broker(jobs, scheduler, clusters, link)
    made.summary()
    try:
        yield made
    finally:
        scheduler.close()
        await store.close()


async def test_a_cycle_plans_the_jobs_its_offer_slots_could_take_and_a_slack(
    broker: Broker,
) -> None:
    await broker.submit(120)
    await broker.scheduler.run_cycle()
    assert len(broker.link.offers) == WINDOW
    cycle = broker.scheduler.last_cycle
    assert cycle is not None
    assert len(cycle.planned) == WINDOW + scheduling.SLOT_SLACK  # not the budget's 500
    assert cycle.deferred == 120 - WINDOW - scheduling.SLOT_SLACK
    told = broker.jobs.waiting(cycle.planned[-1].job_id)
    assert told is not None and "ClusterBusy" in str(told.details)  # why says so
    assert broker.scheduler.busy  # every slot taken


async def test_a_full_window_holds_cycles_until_an_answer_frees_a_slot(broker: Broker) -> None:
    await broker.submit(10)
    loop = asyncio.create_task(broker.scheduler.run())
    try:
        async with asyncio.timeout(5):
            while len(broker.link.offers) < WINDOW or not broker.scheduler.busy:
                await asyncio.sleep(0.01)
        cycles = broker.scheduler.cycles
        await broker.submit(5, start=10)  # wakeups: new jobs, a summary
        broker.summary()
        await asyncio.sleep(0.3)
        assert broker.scheduler.cycles == cycles  # nothing could be sent: no cycle ran
        assert broker.scheduler.cycles_held >= 1
        assert len(broker.link.offers) == WINDOW
        await broker.accept(broker.link.offers[0])  # one slot free: the next cycle runs
        async with asyncio.timeout(2):
            while len(broker.link.offers) < WINDOW + 1:
                await asyncio.sleep(0.01)
        assert broker.scheduler.cycles > cycles
        await asyncio.sleep(0.3)
        assert len(broker.link.offers) == WINDOW + 1  # the window is full again
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_held_cycle_still_runs_once_max_interval_has_passed(broker: Broker) -> None:
    broker.scheduler.max_interval = 0.5
    await broker.submit(3)
    loop = asyncio.create_task(broker.scheduler.run())
    try:
        async with asyncio.timeout(5):
            while not broker.scheduler.busy:
                await asyncio.sleep(0.01)
        cycles = broker.scheduler.cycles
        await broker.submit(1, start=3)  # a new job: it waits to be told why
        await asyncio.sleep(0.1)
        assert broker.jobs.waiting("j3") is None
        async with asyncio.timeout(3):  # within max_interval of the last cycle
            while broker.jobs.waiting("j3") is None:
                await asyncio.sleep(0.02)
        assert broker.scheduler.cycles > cycles
        told = broker.jobs.waiting("j3")
        assert told is not None and "ClusterBusy" in str(told.details)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
