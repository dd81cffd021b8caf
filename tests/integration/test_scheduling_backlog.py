"""The scheduler shell with a parked backlog, on a real job book (SQLite): jobs that do not
fit sit out the cycles, still count as pending and keep the reasons `why` shows; capacity
freed brings the ones it could admit back; and a broker that parks dispatches, cycle by
cycle, exactly what one that plans every job every cycle dispatches. With the agent's offer
window full, a cycle plans no more jobs than it could send offers for (and a slack), and a
wakeup runs no cycle until an answer frees a slot or `max_interval` passes: before, most
cycles of a 20,000-job soak's burst planned 500 jobs to send a few offers, or none."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from broker.api import messages, status
from broker.api.status import JobState
from broker.jobs import fleet, scheduling, service
from broker.state import records, sqlite
from broker.telemetry import metrics
from gpufed import logs
from tests import fakes
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"


@dataclass
class Broker:
    jobs: service.Jobs
    scheduler: scheduling.Scheduler
    clusters: fleet.Fleet
    link: fakes.RecordingLink
    seq: int = 1

    async def summary(self, free_nodes: int) -> None:
        """The agent's next summary: `free_nodes` of its 8 nodes with all 8 GPUs free."""
        self.seq += 1
        hist = [8 - free_nodes] + [0] * 7 + [free_nodes]
        summary = make_summary("east", make_model_summary(H100, nodes_by_free=hist), seq=self.seq)
        self.clusters.clusters["east"].apply_summary(messages.Summary(summary=summary, full=True))

    async def submit(self, job_id: str, *, pods: int) -> None:
        job = make_job(job_id, gpus=8).model(H100).gang(pods).build()
        await self.jobs.submit(status.JobRecord(id=job_id, tenant="team-a", job=job))

    def dispatched(self) -> list[str]:
        return [o.job_id for o in self.link.offers]

    def parked(self) -> set[str]:
        return set(self.scheduler.backlog.parked())

    async def accept(self, offer: messages.Offer) -> None:
        """The agent accepts `offer` (through `AgentReports`): a slot of its window is free."""
        pods = [
            status.PodPlacement(name=f"{offer.job_id}-{i}", task=task.name, node="n0")
            for task in offer.job.spec.tasks
            for i in range(task.replicas)
        ]
        answer = messages.Accepted(job_id=offer.job_id, epoch=offer.epoch, pods=pods)
        await self.jobs.reports.accepted(self.clusters.clusters["east"], answer)


async def start(
    *, full_replan: bool = False, max_offers_in_flight: int = fleet.MAX_OFFERS_IN_FLIGHT
) -> AsyncIterator[Broker]:
    store = await sqlite.SqliteStore.open(":memory:")
    clusters = fleet.Fleet(max_offers_in_flight=max_offers_in_flight)
    meters = metrics.BrokerMetrics()
    jobs = service.Jobs(records.JobStore(store), clusters, meters=meters)
    scheduler = scheduling.Scheduler(
        jobs.book,
        clusters,
        dispatcher=jobs.dispatcher,
        accounts=jobs.accounts,
        victims=jobs.victims,
        meters=meters,
        full_replan=full_replan,
    )
    link = fakes.RecordingLink()
    await clusters.attach("east", link, epoch=1)
    broker = Broker(jobs, scheduler, clusters, link)
    await broker.summary(free_nodes=2)
    try:
        yield broker
    finally:
        scheduler.close()
        await store.close()


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async for item in start():
        yield item


@pytest.fixture
async def twin() -> AsyncIterator[Broker]:
    async for item in start(full_replan=True):
        yield item


WINDOW = 2


@pytest.fixture
async def windowed() -> AsyncIterator[Broker]:
    """An agent that may be sent `WINDOW` offers unanswered, its 8 nodes free."""
    async for item in start(max_offers_in_flight=WINDOW):
        item.scheduler.max_interval = 5.0
        await item.summary(free_nodes=8)
        yield item


def pending_gauge(b: Broker) -> float:
    value = b.jobs.meters.registry.get_sample_value("gpufed_pending_jobs", {"queue": "default"})
    return value or 0.0


def parked_gauge(b: Broker) -> float:
    value = b.jobs.meters.registry.get_sample_value("gpufed_parked_jobs")
    return -1.0 if value is None else value


async def test_each_line_a_cycle_logs_carries_the_cycle_s_number(broker: Broker) -> None:
    """A job's Dispatched line names the cycle that dispatched it (`cycle`, through the JSON
    formatter), and the next cycle's lines the next number."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter(service="gpufed-test"))
    logger = logging.getLogger("broker")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        await broker.submit("first", pods=1)
        await broker.scheduler.run_cycle()
        await broker.submit("second", pods=1)
        await broker.scheduler.run_cycle()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    moves = {
        (line["job_id"], line["state"]): line.get("cycle") for line in lines if "state" in line
    }
    assert moves == {("first", "Dispatched"): "1", ("second", "Dispatched"): "2"}
    assert broker.scheduler.cycle_number == 2


async def test_a_parked_job_is_pending_and_why_keeps_its_reasons(broker: Broker) -> None:
    for i in range(4):
        await broker.submit(f"big{i}", pods=4)  # 4 nodes wanted, 2 free
    await broker.submit("small", pods=1)
    await broker.scheduler.run_cycle()
    assert [o.job_id for o in broker.link.offers] == ["small"]
    assert broker.parked() == {f"big{i}" for i in range(4)}
    before = broker.jobs.waiting("big0")
    assert before is not None and before.reasons
    assert "not enough free" in before.reasons[0]

    await broker.scheduler.run_cycle()  # nothing changed: nothing planned
    assert broker.scheduler.last_cycle is not None
    assert broker.scheduler.last_cycle.planned == []
    assert broker.jobs.waiting("big0") == before
    # parked jobs are still pending for the queue views, the API and the gauges
    assert {p.job_id for p in broker.jobs.pending()} == {f"big{i}" for i in range(4)}
    assert broker.scheduler.backlog.pending_per_queue() == {"default": 4}
    assert pending_gauge(broker) == 4
    assert parked_gauge(broker) == 4  # of the 4 pending, all set aside
    age = broker.jobs.meters.registry.get_sample_value(
        "gpufed_pending_oldest_age_seconds", {"queue": "default"}
    )
    assert age is not None and 0 <= age < 60


async def test_capacity_freed_dispatches_the_job_it_admits(broker: Broker) -> None:
    for i in range(3):
        await broker.submit(f"big{i}", pods=4)
    await broker.scheduler.run_cycle()
    assert broker.link.offers == []
    await broker.summary(free_nodes=3)  # still short of 4: nobody wakes
    await broker.scheduler.run_cycle()
    assert broker.scheduler.last_cycle is not None
    assert broker.scheduler.last_cycle.planned == []
    await broker.summary(free_nodes=5)
    await broker.scheduler.run_cycle()
    assert [o.job_id for o in broker.link.offers] == ["big0"]  # the oldest
    waiting = broker.jobs.waiting("big1")
    assert waiting is not None
    assert {r.code.value for r in waiting.details} == {"Priority"}  # big0 took the room
    await broker.scheduler.run_cycle()  # planned once more before they park: why is fresh
    assert broker.parked() == {"big1", "big2"}
    waiting = broker.jobs.waiting("big1")
    assert waiting is not None
    assert {r.code.value for r in waiting.details} == {"Capacity"}


async def test_a_cancelled_parked_job_leaves_the_backlog(broker: Broker) -> None:
    await broker.submit("big", pods=4)
    await broker.scheduler.run_cycle()
    assert broker.parked() == {"big"}
    await broker.jobs.cancel("big")
    assert parked_gauge(broker) == 1
    await broker.scheduler.run_cycle()
    assert broker.parked() == set()
    assert len(broker.scheduler.backlog) == 0
    assert pending_gauge(broker) == 0
    assert parked_gauge(broker) == 0


async def test_parking_dispatches_what_the_full_replan_dispatches(
    broker: Broker, twin: Broker
) -> None:
    steps: list[tuple[str, int]] = [
        ("submit", 4),
        ("submit", 1),
        ("submit", 2),
        ("submit", 3),
        ("cycle", 0),
        ("summary", 3),
        ("cycle", 0),
        ("submit", 1),
        ("summary", 6),
        ("cycle", 0),
        ("finish", 0),
        ("summary", 8),
        ("cycle", 0),
        ("cycle", 0),
    ]
    most_parked = 0
    for n, (kind, arg) in enumerate(steps):
        for b in (broker, twin):
            if kind == "submit":
                await b.submit(f"j{n}", pods=arg)
            elif kind == "summary":
                await b.summary(free_nodes=arg)
            elif kind == "finish":  # the oldest running job succeeded
                job_id = min(b.jobs.book.holding())
                draft = b.jobs.book.draft(job_id)
                assert draft is not None
                draft.record(JobState.SUCCEEDED, "Succeeded", "done")
                await b.jobs.book.commit([draft])
            else:
                await b.scheduler.run_cycle()
        assert broker.dispatched() == twin.dispatched(), f"after step {n} ({kind})"
        most_parked = max(most_parked, len(broker.parked()))
    assert len(broker.dispatched()) >= 3
    assert most_parked >= 2
    assert twin.parked() == set()


async def test_the_recount_of_holdings_takes_at_most_its_share_of_the_time(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Accounting.resync` walks every job holding GPUs: however many there are, the cycles
    recount no more than `RESYNC_SHARE` of the time, and at least every `resync_every`."""
    recounts: list[float] = []
    clock = [1000.0]
    counted = broker.jobs.accounts.resync

    def slow_recount() -> None:  # as 20,000 holders would: 0.2 s of the clock
        recounts.append(clock[0])
        counted()
        clock[0] += 0.2

    monkeypatch.setattr(broker.jobs.accounts, "resync", slow_recount)
    monkeypatch.setattr(scheduling.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(scheduling.time, "perf_counter", lambda: clock[0])
    broker.scheduler._resynced_at = clock[0]
    for _ in range(700):  # cycles over 70 s of the clock
        await broker.scheduler.run_cycle()
        clock[0] += 0.1
    gaps = [b - a for a, b in itertools.pairwise(recounts)]
    assert recounts and recounts[0] == pytest.approx(1005.0, abs=0.15)  # after resync_every
    assert len(gaps) >= 2 and all(g >= 0.2 / scheduling.RESYNC_SHARE for g in gaps), gaps
    assert all(g <= 0.2 / scheduling.RESYNC_SHARE + 0.5 for g in gaps), gaps  # not starved


async def test_a_cycle_plans_the_jobs_its_offer_slots_could_take_and_a_slack(
    windowed: Broker,
) -> None:
    for n in range(120):
        await windowed.submit(f"j{n}", pods=1)
    await windowed.scheduler.run_cycle()
    assert len(windowed.link.offers) == WINDOW
    cycle = windowed.scheduler.last_cycle
    assert cycle is not None
    assert len(cycle.planned) == WINDOW + scheduling.SLOT_SLACK  # not the budget's 500
    assert cycle.deferred == 120 - WINDOW - scheduling.SLOT_SLACK
    told = windowed.jobs.waiting(cycle.planned[-1].job_id)
    assert told is not None and "ClusterBusy" in str(told.details)  # why says so
    assert windowed.scheduler.busy  # every slot taken


async def test_a_full_window_holds_cycles_until_an_answer_frees_a_slot(windowed: Broker) -> None:
    for n in range(10):
        await windowed.submit(f"j{n}", pods=1)
    loop = asyncio.create_task(windowed.scheduler.run())
    try:
        async with asyncio.timeout(5):
            while len(windowed.link.offers) < WINDOW or not windowed.scheduler.busy:
                await asyncio.sleep(0.01)
        cycles = windowed.scheduler.cycles
        for n in range(10, 15):  # wakeups: new jobs, a summary
            await windowed.submit(f"j{n}", pods=1)
        await windowed.summary(free_nodes=8)
        windowed.clusters.changed.set()
        await asyncio.sleep(0.3)
        assert windowed.scheduler.cycles == cycles  # nothing could be sent: no cycle ran
        assert windowed.scheduler.cycles_held >= 1
        assert len(windowed.link.offers) == WINDOW
        await windowed.accept(windowed.link.offers[0])  # one slot free: the next cycle runs
        async with asyncio.timeout(2):
            while len(windowed.link.offers) < WINDOW + 1:
                await asyncio.sleep(0.01)
        assert windowed.scheduler.cycles > cycles
        await asyncio.sleep(0.3)
        assert len(windowed.link.offers) == WINDOW + 1  # the window is full again
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_a_held_cycle_still_runs_once_max_interval_has_passed(windowed: Broker) -> None:
    windowed.scheduler.max_interval = 0.5
    for n in range(3):
        await windowed.submit(f"j{n}", pods=1)
    loop = asyncio.create_task(windowed.scheduler.run())
    try:
        async with asyncio.timeout(5):
            while not windowed.scheduler.busy:
                await asyncio.sleep(0.01)
        cycles = windowed.scheduler.cycles
        await windowed.submit("j3", pods=1)  # a new job: it waits to be told why
        await asyncio.sleep(0.1)
        assert windowed.jobs.waiting("j3") is None
        async with asyncio.timeout(3):  # within max_interval of the last cycle
            while windowed.jobs.waiting("j3") is None:
                await asyncio.sleep(0.02)
        assert windowed.scheduler.cycles > cycles
        told = windowed.jobs.waiting("j3")
        assert told is not None and "ClusterBusy" in str(told.details)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
