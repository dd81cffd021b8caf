"""The broker runs a job again on the same cluster: what the agent says about the earlier
attempt changes nothing, and only that attempt's leftovers are cancelled (the job
collaborators over an in-memory SQLite store)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from broker.api import messages, status
from broker.jobs import fleet, service
from broker.planning import fitting, planning
from broker.state import records, sqlite
from broker.telemetry import metrics
from tests import fakes
from tests.builders import make_job

H100 = "NVIDIA-H100-80GB-HBM3"
State = status.JobState


class RecordingLink(fakes.SentLink):
    """An agent session that keeps what the broker sends."""

    def cancels(self) -> list[tuple[str, int]]:
        return [(m.reason, m.attempt) for m in self.sent if isinstance(m, messages.Cancel)]

    def offers(self) -> list[int]:
        return [m.attempt for m in self.sent if isinstance(m, messages.Offer)]


class Broker:
    """The job collaborators on an in-memory store with one connected cluster, `east`."""

    def __init__(self, jobs: service.Jobs, cluster: fleet.Cluster) -> None:
        self.jobs = jobs
        self.cluster = cluster
        self.link = RecordingLink()
        cluster.link = self.link

    @property
    def record(self) -> status.JobRecord:
        record = self.jobs.get("j1")
        assert record is not None
        return record

    async def dispatch(self) -> None:
        take = fitting.Take(model=H100, rack=None, from_free=8, gpus=8)
        plan = planning.CyclePlan(assignments=[planning.Assignment("j1", "east", takes=(take,))])
        assert (await self.jobs.dispatcher.dispatch(plan)).sent == 1

    async def update(self, state: State, *, attempt: int, reason: str = "", pods: int = 0) -> None:
        await self.jobs.reports.job_update(
            self.cluster,
            messages.JobUpdate(
                job_id="j1",
                epoch=1,
                state=state,
                reason=reason,
                attempt=attempt,
                pods=[
                    status.PodStatus(name=f"j1-worker-{i}", task="worker", node=f"n{i}")
                    for i in range(pods)
                ],
            ),
        )
        await self.jobs.book.flush()  # the group commit of what agents report

    def view(self) -> tuple[str, int, int, int]:
        """What a user or the scheduler would see: state, attempts, retries, pods."""
        s = self.record.status
        return (s.state.value, s.attempts, s.infra_retries, len(s.pods))


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    """Job j1, its first attempt failed with NodeLost on east, its second offered to east."""
    backing = await sqlite.SqliteStore.open(":memory:")
    clusters = fleet.Fleet()
    cluster = await clusters.attach("east", RecordingLink(), epoch=1)
    jobs = service.Jobs(records.JobStore(backing), clusters, meters=metrics.BrokerMetrics())
    job = make_job("j1", gpus=8).model(H100).build()
    await jobs.submit(status.JobRecord(id="j1", tenant="team-a", job=job))
    b = Broker(jobs, cluster)
    await b.dispatch()
    await b.update(State.RUNNING, attempt=1, pods=1)
    await b.update(State.FAILED, attempt=1, reason="NodeLost", pods=1)
    assert b.record.status.state == State.QUEUED
    await b.dispatch()
    try:
        yield b
    finally:
        await backing.close()


async def test_each_dispatch_offers_the_next_attempt(broker: Broker) -> None:
    assert broker.link.offers() == [1, 2]
    assert broker.view() == ("Dispatched", 2, 1, 0)
    # the second attempt's own updates do count
    await broker.update(State.RUNNING, attempt=2, pods=2)
    assert broker.view() == ("Running", 2, 1, 2)


@pytest.mark.parametrize(
    ("state", "reason", "cancels"),
    [
        pytest.param(State.RUNNING, "", [("Stale", 1)], id="running: that copy is cancelled"),
        pytest.param(State.FAILED, "NodeLost", [], id="failed again: no second retry"),
        pytest.param(State.SUCCEEDED, "", [], id="succeeded: not the job's end"),
        pytest.param(State.CANCELLED, "Preempted", [], id="cancelled: not requeued"),
    ],
)
async def test_an_update_of_the_earlier_attempt_changes_nothing(
    broker: Broker, state: State, reason: str, cancels: list[tuple[str, int]]
) -> None:
    events = len(broker.record.status.events)
    await broker.update(state, attempt=1, reason=reason, pods=3)
    assert broker.view() == ("Dispatched", 2, 1, 0)
    assert len(broker.record.status.events) == events
    assert broker.link.cancels() == cancels


async def test_an_earlier_attempts_answer_to_its_offer_changes_nothing(broker: Broker) -> None:
    placed = [status.PodPlacement(name="j1-worker-0", task="worker", node="n0")]
    await broker.jobs.reports.accepted(
        broker.cluster, messages.Accepted(job_id="j1", epoch=1, pods=placed, attempt=1)
    )
    await broker.jobs.reports.rejected(
        broker.cluster, messages.Rejected(job_id="j1", epoch=1, reasons=["full"], attempt=1)
    )
    assert broker.view() == ("Dispatched", 2, 1, 0)
    assert not broker.cluster.inflight["j1"].accepted  # still waiting for attempt 2's answer
    assert broker.cluster.rejected == {}
    assert broker.link.cancels() == [("Stale", 1)]


async def test_a_hello_with_only_the_earlier_attempt_means_the_later_one_was_lost(
    broker: Broker,
) -> None:
    """The offer of attempt 2 went out as the session dropped: the agent still lists attempt 1
    (running on) and not attempt 2. That copy is cancelled, and the job runs again."""
    held = messages.AgentJob(job_id="j1", epoch=1, state=State.RUNNING, attempt=1)
    await broker.jobs.reports.hello(broker.cluster, messages.Hello(cluster="east", jobs=[held]))
    assert broker.link.cancels() == [("Stale", 1)]
    assert broker.view() == ("Queued", 2, 2, 0)
    assert broker.record.status.events[-1].reason == "LostByAgent"


async def test_a_cancel_names_the_current_attempt(broker: Broker) -> None:
    await broker.jobs.cancel(broker.record.id)
    assert broker.link.cancels() == [("Cancelled", 2)]
