"""A lost cluster on the broker's side, per job's `spec.failurePolicy.clusterLost`: requeue
(the default) runs the job elsewhere, wait keeps it on its cluster, says so in its events and
`why`, and picks it up again when the cluster returns; the job collaborators over a real
SQLite store. And the policy field itself: validated at submit, read leniently from the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pydantic
import pytest
import yaml

from broker.api import jobs, messages, status
from broker.http import jobs as job_routes
from broker.jobs import fleet, service, transitions
from broker.planning import fitting, planning
from broker.state import records, sqlite
from broker.telemetry import metrics
from tests import fakes
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
State = status.JobState


class Broker:
    def __init__(self, jobs: service.Jobs, clusters: fleet.Fleet) -> None:
        self.jobs = jobs
        self.fleet = clusters

    def get(self, job_id: str) -> status.JobRecord:
        record = self.jobs.get(job_id)
        assert record is not None
        return record

    async def report(self, job_id: str, state: State) -> None:
        update = messages.JobUpdate(job_id=job_id, epoch=1, state=state)
        await self.jobs.reports.job_update(self.fleet.clusters["east"], update, session=1)
        async with self.jobs.book.lock:
            await self.jobs.book.flush()

    async def lose_east(self) -> int:
        """The watchdog's part: the session went, and stayed away past the grace."""
        east = self.fleet.clusters["east"]
        assert east.link is not None
        self.fleet.detach("east", east.link)
        moved = await self.jobs.reports.cluster_lost("east")
        east.lost = True
        return moved


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    backing = await sqlite.SqliteStore.open(":memory:")
    clusters = fleet.Fleet(offer_timeout_seconds=30.0)
    east = await clusters.attach("east", fakes.SentLink(), epoch=1)
    summary = make_summary("east", make_model_summary(H100, nodes_by_free=[0] * 8 + [2]))
    east.apply_summary(messages.Summary(summary=summary))
    book = service.Jobs(records.JobStore(backing), clusters, meters=metrics.BrokerMetrics())
    requeued = make_job("requeued", gpus=8).model(H100).build()
    waits = make_job("waits", gpus=8).model(H100).cluster_lost("wait").build()
    for job_id, job in (("requeued", requeued), ("waits", waits)):
        await book.submit(status.JobRecord(id=job_id, tenant="team-a", job=job))
    take = fitting.Take(model=H100, rack=None, from_free=8, gpus=8)
    plan = planning.CyclePlan(
        assignments=[
            planning.Assignment("requeued", "east", takes=(take,)),
            planning.Assignment("waits", "east", takes=(take,)),
        ]
    )
    assert (await book.dispatcher.dispatch(plan)).sent == 2
    b = Broker(book, clusters)
    for job_id in ("requeued", "waits"):
        await b.report(job_id, State.RUNNING)
    try:
        yield b
    finally:
        await book.close()
        await backing.close()


async def test_a_lost_cluster_requeues_its_jobs_but_not_those_that_wait_for_it(
    broker: Broker,
) -> None:
    assert await broker.lose_east() == 1
    requeued = broker.get("requeued")
    assert (requeued.status.state, requeued.status.cluster) == (State.QUEUED, None)
    assert requeued.status.events[-1].reason == "ClusterLost"
    waits = broker.get("waits")
    assert (waits.status.state, waits.status.cluster) == (State.RUNNING, "east")
    last = waits.status.events[-1]
    assert (last.state, last.reason) == (State.RUNNING, transitions.WAITING_FOR_CLUSTER)
    assert "not restarted elsewhere" in last.message
    why = job_routes.why_answer(waits, broker.jobs, None)
    assert why.message.startswith("Running on east; waiting for its cluster: east unreachable")
    # the watchdog does it once; were it asked again, the job would not pile up events
    assert await broker.jobs.reports.cluster_lost("east") == 0
    assert len(broker.get("waits").status.events) == len(waits.status.events)


async def test_a_waiting_job_goes_on_when_its_cluster_returns(broker: Broker) -> None:
    await broker.lose_east()
    east = await broker.fleet.attach("east", fakes.SentLink(), epoch=2)
    running = messages.AgentJob(job_id="waits", epoch=1, state=State.RUNNING)
    await broker.jobs.reports.hello(east, messages.Hello(cluster="east", jobs=[running]))
    waits = broker.get("waits")
    assert (waits.status.state, waits.status.cluster, waits.status.epoch) == (
        State.RUNNING,
        "east",
        2,
    )
    assert waits.status.events[-1].reason == transitions.CLUSTER_RETURNED
    assert job_routes.why_answer(waits, broker.jobs, None).message == "Running on east"
    assert waits.status.attempts == 1  # never run anywhere else


async def test_cancelling_a_job_that_waits_for_a_lost_cluster_ends_it_at_once(
    broker: Broker,
) -> None:
    await broker.lose_east()
    cancelled = await broker.jobs.cancel("waits")
    assert cancelled is not None and cancelled.status.state == State.CANCELLED
    # the agent that returns holding it is told to delete the stale copy
    link = fakes.SentLink()
    east = await broker.fleet.attach("east", link, epoch=2)
    running = messages.AgentJob(job_id="waits", epoch=1, state=State.RUNNING)
    await broker.jobs.reports.hello(east, messages.Hello(cluster="east", jobs=[running]))
    assert [(m.job_id, m.reason) for m in link.sent if isinstance(m, messages.Cancel)] == [
        ("waits", "Stale")
    ]


async def test_a_job_its_agent_fenced_before_the_grace_ended_is_requeued(
    broker: Broker,
) -> None:
    """A partition longer than the agent's fence time but shorter than the broker's grace:
    the agent comes back having stopped the job (Cancelled, ClusterLost)."""
    east = await broker.fleet.attach("east", fakes.SentLink(), epoch=2)
    fenced = messages.AgentJob(
        job_id="requeued", epoch=1, state=State.CANCELLED, reason="ClusterLost"
    )
    running = messages.AgentJob(job_id="waits", epoch=1, state=State.RUNNING)
    await broker.jobs.reports.hello(east, messages.Hello(cluster="east", jobs=[fenced, running]))
    requeued = broker.get("requeued")
    assert (requeued.status.state, requeued.status.events[-1].reason) == (
        State.QUEUED,
        "ClusterLost",
    )
    assert broker.get("waits").status.state == State.RUNNING


def spec_with(policy: object) -> dict[str, object]:
    document = make_job("j", gpus=1).document()
    document["spec"]["failurePolicy"] = {"clusterLost": policy}
    return document


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        pytest.param("requeue", jobs.ClusterLostPolicy.REQUEUE, id="requeue"),
        pytest.param("wait", jobs.ClusterLostPolicy.WAIT, id="wait"),
    ],
)
def test_the_policy_is_read_at_submit(policy: str, expected: jobs.ClusterLostPolicy) -> None:
    assert jobs.validate_submitted(spec_with(policy)).spec.cluster_lost == expected


def test_a_job_without_a_policy_requeues_and_offers_leave_the_field_out() -> None:
    job = jobs.validate_submitted(make_job("j", gpus=1).document())
    assert job.spec.cluster_lost == jobs.ClusterLostPolicy.REQUEUE
    offer = messages.Offer(job_id="j", epoch=1, tenant="t", job=job)
    assert "failurePolicy" not in messages.encode(offer)  # agents of protocol 2 forbid it


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("Wait", id="case"),
        pytest.param("fail", id="unknown"),
        pytest.param(1, id="int"),
    ],
)
def test_a_bad_policy_is_refused_at_submit_naming_the_field(policy: object) -> None:
    with pytest.raises(pydantic.ValidationError) as refused:
        jobs.validate_submitted(spec_with(policy))
    assert [e["loc"] for e in refused.value.errors()] == [("spec", "failurePolicy", "clusterLost")]


def test_a_stored_job_with_a_policy_this_broker_does_not_know_still_loads_as_requeue() -> None:
    stored = jobs.GPUJob.model_validate(spec_with("fail"))
    assert stored.spec.cluster_lost == jobs.ClusterLostPolicy.REQUEUE


def test_the_example_job_that_waits_for_its_cluster_is_valid() -> None:
    path = Path(__file__).resolve().parents[2] / "config/examples/train-waits-for-its-cluster.yaml"
    job = jobs.validate_submitted(yaml.safe_load(path.read_text()))
    assert job.spec.cluster_lost == jobs.ClusterLostPolicy.WAIT


async def test_a_hello_in_step_with_the_broker_writes_no_record(broker: Broker) -> None:
    """A reconnect of an agent holding its jobs as the broker has them rewrites none of them
    (thousands held: thousands of writes for nothing); a job the hello moves is written."""
    before = {job_id: broker.jobs.book.revision_of(job_id) for job_id in ("requeued", "waits")}
    pods = list(broker.get("requeued").status.pods)
    east = await broker.fleet.attach("east", fakes.SentLink(), epoch=2)
    held = [
        messages.AgentJob(job_id="requeued", epoch=1, state=State.RUNNING, pods=pods),
        messages.AgentJob(job_id="waits", epoch=1, state=State.SUCCEEDED),
    ]
    await broker.jobs.reports.hello(east, messages.Hello(cluster="east", jobs=held))
    assert broker.jobs.book.revision_of("requeued") == before["requeued"]
    assert broker.get("requeued").status.epoch == 1  # the session it was last written in
    finished = broker.get("waits")
    assert broker.jobs.book.revision_of("waits") > before["waits"]
    assert (finished.status.state, finished.status.epoch) == (State.SUCCEEDED, 2)
