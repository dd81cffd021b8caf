"""A job's failure policy and deadline as the broker applies them (the job collaborators over
an SQLite store, one recording agent link): `backoffLimit` and `retryOn` decide whether a
failed attempt runs again, `activeDeadlineSeconds` fails the job from the times stored with
it (also after a restart) and has its pods deleted, a checkpoint report is kept for victim
choice, a preemption's Cancel carries the job's grace period, `ttlSecondsAfterFinished`
shortens the job's stay in the hot store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker.api import messages, status
from broker.jobs import fleet, retiring, service
from broker.planning import fitting, planning
from broker.state import records, sqlite
from broker.telemetry import metrics
from tests import fakes
from tests.builders import JobBuilder, make_job

H100 = "NVIDIA-H100-80GB-HBM3"
State = status.JobState


class RecordingLink(fakes.SentLink):
    def cancels(self) -> list[messages.Cancel]:
        return [m for m in self.sent if isinstance(m, messages.Cancel)]


class Broker:
    """The job collaborators on a store with one connected cluster, `east`."""

    def __init__(self, backing: sqlite.SqliteStore) -> None:
        self.backing = backing
        self.link = RecordingLink()
        self.clusters = fleet.Fleet()
        meters = metrics.BrokerMetrics()
        self.jobs = service.Jobs(records.JobStore(backing), self.clusters, meters=meters)

    async def start(self) -> Broker:
        await self.jobs.load()
        self.cluster = await self.clusters.attach("east", self.link, epoch=1)
        return self

    def record(self, job_id: str = "j1") -> status.JobRecord:
        record = self.jobs.get(job_id)
        assert record is not None
        return record

    async def submit(self, builder: JobBuilder, job_id: str = "j1") -> None:
        await self.jobs.submit(status.JobRecord(id=job_id, tenant="team-a", job=builder.build()))

    async def dispatch(self, job_id: str = "j1") -> None:
        take = fitting.Take(model=H100, rack=None, from_free=8, gpus=8)
        plan = planning.CyclePlan(assignments=[planning.Assignment(job_id, "east", takes=(take,))])
        assert (await self.jobs.dispatcher.dispatch(plan)).sent == 1

    async def update(self, state: State, *, job_id: str = "j1", **fields: Any) -> None:
        record = self.record(job_id)
        await self.jobs.reports.job_update(
            self.cluster,
            messages.JobUpdate(
                job_id=job_id, epoch=1, state=state, attempt=record.status.attempts, **fields
            ),
        )
        await self.jobs.book.flush()

    async def run_and_fail(self, reason: str, job_id: str = "j1") -> None:
        await self.dispatch(job_id)
        await self.update(State.RUNNING, job_id=job_id)
        await self.update(State.FAILED, job_id=job_id, reason=reason)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    backing = await sqlite.SqliteStore.open(str(tmp_path / "broker.db"))
    try:
        yield await Broker(backing).start()
    finally:
        await backing.close()


def job(**policy: Any) -> JobBuilder:
    builder = make_job("j1", gpus=8).model(H100)
    return builder.failure_policy(**policy) if policy else builder


# ---- backoffLimit and retryOn -------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "failures", "outcome"),
    [
        pytest.param({}, ["NodeLost"] * 3, ("Queued", 3), id="default: 3 NodeLost retried"),
        pytest.param({}, ["NodeLost"] * 4, ("Failed", 3), id="default: the 4th fails"),
        pytest.param({}, ["Error"], ("Failed", 0), id="default: Error is never retried"),
        pytest.param({"backoffLimit": 1}, ["NodeLost"], ("Queued", 1), id="limit 1: one retry"),
        pytest.param(
            {"backoffLimit": 1}, ["NodeLost", "Evicted"], ("Failed", 1), id="limit 1: 2 attempts"
        ),
        pytest.param({"backoffLimit": 0}, ["NodeLost"], ("Failed", 0), id="limit 0: no retry"),
        pytest.param(
            {"retryOn": ["OOMKilled"]}, ["OOMKilled"], ("Queued", 1), id="retryOn: OOMKilled too"
        ),
        pytest.param(
            {"retryOn": ["OOMKilled"]}, ["NodeLost"], ("Failed", 0), id="retryOn replaces default"
        ),
        pytest.param({"retryOn": []}, ["NodeLost"], ("Failed", 0), id="retryOn []: nothing"),
    ],
)
async def test_a_failed_attempt_runs_again_as_the_policy_says(
    broker: Broker, policy: dict[str, Any], failures: list[str], outcome: tuple[str, int]
) -> None:
    await broker.submit(job(**policy))
    for reason in failures:
        await broker.run_and_fail(reason)
    record = broker.record()
    assert (record.status.state.value, record.status.infra_retries) == outcome
    assert record.status.attempts == len(failures)
    assert record.status.events[-1].reason == failures[-1]


async def test_the_failure_that_exhausts_the_limit_says_so(broker: Broker) -> None:
    await broker.submit(job(backoffLimit=1))
    await broker.run_and_fail("NodeLost")
    assert broker.record().status.events[-1].message.startswith("retry 1 of 1")
    await broker.run_and_fail("NodeLost")
    assert "backoffLimit 1 reached" in broker.record().status.events[-1].message


async def test_a_job_its_agent_lost_is_a_failed_attempt_too(broker: Broker) -> None:
    """The agent's hello does not list it (its pods vanished): LostByAgent, retried within
    the limit and then failed, rather than requeued for ever."""
    await broker.submit(job(backoffLimit=1))
    for expected in ("Queued", "Failed"):
        await broker.dispatch()
        await broker.update(State.RUNNING)
        await broker.jobs.reports.hello(broker.cluster, messages.Hello(cluster="east"))
        assert broker.record().status.state.value == expected
        assert broker.record().status.events[-1].reason == "LostByAgent"


# ---- activeDeadlineSeconds ----------------------------------------------------------------


def started_at(record: status.JobRecord) -> datetime:
    started = record.event_time(State.RUNNING)
    assert started is not None
    return started


async def test_a_job_past_its_deadline_fails_and_its_pods_are_cancelled(broker: Broker) -> None:
    await broker.submit(job(activeDeadlineSeconds=60))
    await broker.dispatch()
    await broker.update(State.RUNNING)
    start = started_at(broker.record())
    assert broker.jobs.deadlines.due == {"j1": start + timedelta(seconds=60)}
    assert await broker.jobs.deadlines.expire_once(now=start + timedelta(seconds=59)) == 0
    assert await broker.jobs.deadlines.expire_once(now=start + timedelta(seconds=61)) == 1
    record = broker.record()
    assert record.status.state == State.FAILED
    assert record.status.events[-1].reason == "DeadlineExceeded"
    assert "activeDeadlineSeconds 60" in record.status.events[-1].message
    [cancel] = broker.link.cancels()
    assert (cancel.reason, cancel.attempt) == ("DeadlineExceeded", 1)
    assert broker.jobs.deadlines.due == {}
    # the agent's report of the deletion comes later and changes nothing
    await broker.update(State.CANCELLED, reason="DeadlineExceeded")
    assert broker.record().status.events[-1].reason == "DeadlineExceeded"


async def test_the_deadline_counts_from_the_first_start_over_every_attempt(
    broker: Broker,
) -> None:
    """Retried after its first attempt failed, it is queued when its deadline passes: it
    fails there, with no pods to delete."""
    await broker.submit(job(activeDeadlineSeconds=60))
    await broker.run_and_fail("NodeLost")
    start = started_at(broker.record())
    assert broker.record().status.state == State.QUEUED
    assert await broker.jobs.deadlines.expire_once(now=start + timedelta(seconds=61)) == 1
    assert broker.record().status.events[-1].reason == "DeadlineExceeded"
    assert broker.link.cancels() == []


async def test_a_job_that_has_not_started_has_no_deadline_yet(broker: Broker) -> None:
    await broker.submit(job(activeDeadlineSeconds=1))
    await broker.dispatch()
    assert broker.jobs.deadlines.due == {}
    assert await broker.jobs.deadlines.expire_once(now=status.utcnow() + timedelta(days=1)) == 0


async def test_a_restarted_broker_finds_the_same_deadline(broker: Broker) -> None:
    await broker.submit(job(activeDeadlineSeconds=60))
    await broker.dispatch()
    await broker.update(State.RUNNING)
    deadline = broker.jobs.deadlines.due["j1"]
    again = await Broker(broker.backing).start()  # a new book loading the same store
    assert again.jobs.deadlines.due == {"j1": deadline}
    assert await again.jobs.deadlines.expire_once(now=deadline + timedelta(seconds=1)) == 1
    assert again.record().status.events[-1].reason == "DeadlineExceeded"


# ---- checkpoints and graceful preemption ----------------------------------------------------


async def test_a_reported_checkpoint_is_kept_and_only_moves_forward(broker: Broker) -> None:
    await broker.submit(job())
    await broker.dispatch()
    await broker.update(State.RUNNING)
    now = status.utcnow()
    await broker.update(State.RUNNING, checkpoint=now)
    await broker.update(State.RUNNING, checkpoint=now - timedelta(minutes=5))
    assert broker.record().status.last_checkpoint == now
    [running] = broker.jobs.running_jobs()
    assert running.checkpointed == now


@pytest.mark.parametrize(
    ("grace", "sent"),
    [
        pytest.param(120, 120.0, id="the job's gracePeriodSeconds"),
        pytest.param(0, 0.0, id="0: no grace"),
        pytest.param(None, 30.0, id="none given: the broker's cancel grace"),
    ],
)
async def test_a_preemption_cancel_carries_the_victims_grace(
    broker: Broker, grace: int | None, sent: float
) -> None:
    builder = job()
    if grace is not None:
        builder.preemption(grace)
    await broker.submit(builder)
    await broker.dispatch()
    await broker.update(State.RUNNING)
    victim = planning.Preemption("j1", "urgent", "east", "Priority", "make room")
    assert await broker.jobs.victims.preempt([victim]) == 1
    [cancel] = broker.link.cancels()
    assert (cancel.reason, cancel.grace_seconds) == ("Preempted", sent)
    entry = broker.jobs.victims.victims["j1"]
    assert entry.timeout == 2 * sent + 30


# ---- ttlSecondsAfterFinished ----------------------------------------------------------------


async def test_a_jobs_ttl_shortens_its_stay_in_the_hot_store(broker: Broker) -> None:
    await broker.submit(job().ttl_after_finished(10), "short")
    await broker.submit(job(), "long")
    for job_id in ("short", "long"):
        await broker.dispatch(job_id)
        await broker.update(State.SUCCEEDED, job_id=job_id)
    finished = status.utcnow()
    later = finished + timedelta(seconds=11)
    book = broker.jobs.book
    assert [r.id for r in retiring.due(book, now=later, retain=3600, batch=10)] == ["short"]
    assert retiring.due(book, now=later, retain=5, batch=10) != []  # both, by the retention
    ttls = broker.jobs.ttls
    due = ttls.next_due(book)
    assert due is not None and finished - timedelta(seconds=1) < due - timedelta(seconds=10)
    # no history: only the job with a TTL goes, deleted
    moved, more = await retiring.retire_once(book, None, retain=3600, now=later)
    assert (moved, more) == (1, False)
    assert broker.jobs.get("short") is None and broker.jobs.get("long") is not None
    assert ttls.next_due(book) is None
