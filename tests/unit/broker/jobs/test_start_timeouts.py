"""A cluster answers for what it accepts (the job collaborators over a real SQLite store, the
agent a recording link): a job not Running within the start timeout is withdrawn, an accept
that names no pods is refused, and the strikes score the cluster down."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from broker.api import messages, status
from broker.jobs import book, fleet, reports, service, starting
from broker.planning import fitting, planning
from broker.state import records, sqlite
from broker.telemetry import metrics
from tests import fakes
from tests.builders import make_job

H100 = "NVIDIA-H100-80GB-HBM3"
State = status.JobState
TIMEOUT = 60.0
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=status.utcnow().tzinfo)


class RecordingLink(fakes.SentLink):
    def cancels(self) -> list[tuple[str, str, int]]:
        return [
            (m.job_id, m.reason, m.attempt) for m in self.sent if isinstance(m, messages.Cancel)
        ]


class Clock:
    """This replica's clocks: monotonic seconds and the wall clock, moved together."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.wall = T0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += timedelta(seconds=seconds)


class Broker:
    """The job collaborators with one connected cluster, `east`, on fake clocks."""

    def __init__(self, backing: sqlite.SqliteStore) -> None:
        self.link = RecordingLink()
        self.clusters = fleet.Fleet(start_timeout_seconds=TIMEOUT)
        self.jobs = service.Jobs(
            records.JobStore(backing), self.clusters, meters=metrics.BrokerMetrics()
        )
        self.clock = Clock()
        self.jobs.starts.clock = lambda: self.clock.now
        self.jobs.starts.wall = lambda: self.clock.wall

    async def start(self) -> Broker:
        await self.jobs.load()
        self.cluster = await self.clusters.attach("east", self.link, epoch=1)
        return self

    def record(self, job_id: str) -> status.JobRecord:
        record = self.jobs.get(job_id)
        assert record is not None
        return record

    async def dispatch(self, job_id: str) -> None:
        """Submitted and offered to east, its Dispatched event stamped `T0`-relative by
        this replica's wall clock (as on the leader that dispatched it)."""
        await self.jobs.submit(
            status.JobRecord(id=job_id, tenant="team-a", job=make_job(gpus=8).build())
        )
        take = fitting.Take(model=H100, rack=None, from_free=8, gpus=8)
        plan = planning.CyclePlan(assignments=[planning.Assignment(job_id, "east", takes=(take,))])
        assert (await self.jobs.dispatcher.dispatch(plan)).sent == 1

    async def accept(self, job_id: str, *, pods: int = 1) -> None:
        placed = [
            status.PodPlacement(name=f"{job_id}-worker-{i}", task="worker", node="n0")
            for i in range(pods)
        ]
        attempt = self.record(job_id).status.attempts
        await self.jobs.reports.accepted(
            self.cluster,
            messages.Accepted(job_id=job_id, epoch=1, pods=placed, attempt=attempt),
        )
        await self.jobs.book.flush()

    async def running(self, job_id: str) -> None:
        attempt = self.record(job_id).status.attempts
        await self.jobs.reports.job_update(
            self.cluster,
            messages.JobUpdate(job_id=job_id, epoch=1, state=State.RUNNING, attempt=attempt),
        )
        await self.jobs.book.flush()

    async def withdraw(self) -> int:
        return await self.jobs.starts.withdraw_once(now=self.clock.now)


@pytest.fixture
async def broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Broker]:
    backing = await sqlite.SqliteStore.open(str(tmp_path / "broker.db"))
    try:
        made = Broker(backing)
        monkeypatch.setattr(status, "utcnow", lambda: made.clock.wall)
        yield await made.start()
    finally:
        await backing.close()


async def test_a_job_accepted_and_not_running_in_time_is_withdrawn(broker: Broker) -> None:
    await broker.dispatch("j1")
    await broker.accept("j1")
    broker.clock.advance(TIMEOUT - 1)
    assert await broker.withdraw() == 0
    broker.clock.advance(2)
    assert await broker.withdraw() == 1
    record = broker.record("j1")
    last = record.status.events[-1]
    assert (last.state, last.reason) == (State.QUEUED, starting.START_TIMEOUT)
    assert last.message == (
        "east: not Running within 60 s of its dispatch (0 of 1 pods Running); withdrawn"
    )
    assert record.status.reasons == [last.message]
    assert broker.link.cancels() == [("j1", starting.START_TIMEOUT, 1)]
    assert "j1" in broker.cluster.rejected  # passed over for it until a newer summary
    assert starting.last_withdrawal(record) == f"StartTimeout: {last.message}"


async def test_a_job_running_in_time_stays(broker: Broker) -> None:
    await broker.dispatch("j1")
    await broker.accept("j1")
    await broker.running("j1")
    broker.clock.advance(TIMEOUT * 10)
    assert await broker.withdraw() == 0
    assert broker.record("j1").status.state == State.RUNNING
    assert broker.jobs.starts.due == {}


async def test_an_unanswered_offer_is_left_to_the_offer_timeout(broker: Broker) -> None:
    await broker.dispatch("j1")
    broker.clock.advance(TIMEOUT + 1)
    assert await broker.withdraw() == 0
    assert broker.record("j1").status.state == State.DISPATCHED


async def test_a_job_of_a_cluster_away_is_withdrawn_once_it_is_back(broker: Broker) -> None:
    await broker.dispatch("j1")
    await broker.accept("j1")
    broker.clusters.detach("east", broker.link)
    broker.clock.advance(TIMEOUT + 1)
    assert await broker.withdraw() == 0  # the lost-cluster grace decides while it is away
    broker.cluster = await broker.clusters.attach("east", broker.link, epoch=2)
    assert await broker.withdraw() == 1
    assert broker.record("j1").status.state == State.QUEUED


@pytest.mark.parametrize(
    ("age", "left"),
    [
        pytest.param(0.0, TIMEOUT, id="dispatched by this replica: the whole timeout"),
        pytest.param(20.0, TIMEOUT - 20, id="dispatched 20 s ago by the former leader"),
        pytest.param(-5.0, TIMEOUT, id="the former leader's clock ahead: never more than it"),
        pytest.param(TIMEOUT * 3, 0.0, id="long past: withdrawn at once, not before now"),
    ],
)
async def test_the_time_left_counts_from_the_recorded_dispatch(
    broker: Broker, age: float, left: float
) -> None:
    """A replica that first sees a Dispatched job (a new leader loading it) counts from the
    dispatch its events record, by its own wall clock; then on its monotonic clock."""
    await broker.dispatch("j1")
    broker.jobs.starts.due.clear()
    broker.clock.advance(age)
    change = book.Change(before=None, after=broker.record("j1"))
    broker.jobs.starts(change)
    assert broker.jobs.starts.due["j1"] == (1, broker.clock.now + left)


async def test_three_withdrawals_score_the_cluster_down(broker: Broker) -> None:
    for job_id in ("j1", "j2", "j3"):
        await broker.dispatch(job_id)
        await broker.accept(job_id)
    broker.clock.advance(TIMEOUT + 1)
    assert not broker.cluster.scored_down(now=broker.clock.now)
    assert await broker.withdraw() == 3
    assert broker.cluster.scored_down(now=broker.clock.now)
    assert broker.cluster.scored_down_reason is not None
    assert broker.cluster.scored_down_reason.startswith("3 jobs it accepted did not start")


async def test_an_accept_naming_no_pods_is_refused(broker: Broker) -> None:
    await broker.dispatch("j1")
    await broker.accept("j1", pods=0)
    record = broker.record("j1")
    last = record.status.events[-1]
    assert (last.state, last.reason) == (State.QUEUED, "Rejected")
    assert last.message == "east: accepted without naming every pod (0 of 1 named)"
    assert broker.link.cancels() == [("j1", reports.ACCEPT_REFUSED, 1)]
    assert broker.cluster.inflight == {}
    assert broker.cluster.starts.strikes  # one strike against it
