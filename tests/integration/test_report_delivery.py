"""Delivery acknowledged both ways, on the broker's side: a final report is acknowledged only
once committed (and again, unchanged, when it arrives twice), and an offer left unanswered is
withdrawn. The job collaborators over a real SQLite store, then the broker app with a silent
agent and a real one (aiohttp server, WebSocket sessions)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import messages, status
from broker.jobs import fleet, service, transitions
from broker.planning import fitting, planning
from broker.state import errors, records, sqlite
from broker.telemetry import metrics
from member_agent import app as agent_app
from tests import agentbuilders, fakes
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
REPO = Path(__file__).resolve().parents[2]
State = status.JobState


class RecordingLink(fakes.SentLink):
    """An agent session that keeps what the broker sends."""

    def acks(self) -> list[tuple[int, list[int]]]:
        return [(m.epoch, m.seqs) for m in self.sent if isinstance(m, messages.Ack)]

    def cancels(self) -> list[tuple[str, int]]:
        return [(m.reason, m.attempt) for m in self.sent if isinstance(m, messages.Cancel)]


class Broker:
    """The job collaborators on an in-memory store; job j1 dispatched to `east`, epoch 1,
    running. `failing` makes the store refuse writes (`conflicting`: with a conflict)."""

    def __init__(self, jobs: service.Jobs, clusters: fleet.Fleet, cluster: fleet.Cluster) -> None:
        self.jobs = jobs
        self.fleet = clusters
        self.cluster = cluster
        self.link = RecordingLink()
        cluster.link = self.link
        self.failing: type[errors.StoreError] | None = None
        store = jobs.book.store
        update = store.update

        async def refusing(changes: Any) -> int:
            if self.failing is not None:
                raise self.failing("injected")
            return await update(changes)

        store.update = refusing  # type: ignore[method-assign]

    @property
    def record(self) -> status.JobRecord:
        record = self.jobs.get("j1")
        assert record is not None
        return record

    async def report(self, state: State, *, seq: int | None, session: int = 1) -> None:
        update = messages.JobUpdate(job_id="j1", epoch=1, state=state, seq=seq)
        await self.jobs.reports.job_update(self.cluster, update, session=session)

    async def flush(self) -> None:
        async with self.jobs.book.lock:
            with contextlib.suppress(errors.StoreError):
                await self.jobs.book.flush()
        await settle()

    async def reconnect(self, epoch: int) -> RecordingLink:
        self.link = RecordingLink()
        self.cluster = await self.fleet.attach("east", self.link, epoch=epoch)
        return self.link


async def settle() -> None:
    """Let the acknowledgements that came due go out."""
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    backing = await sqlite.SqliteStore.open(":memory:")
    clusters = fleet.Fleet(offer_timeout_seconds=30.0)
    cluster = await clusters.attach("east", RecordingLink(), epoch=1)
    summary = make_summary("east", make_model_summary(H100, nodes_by_free=[0] * 8 + [2]))
    cluster.apply_summary(messages.Summary(summary=summary))
    jobs = service.Jobs(records.JobStore(backing), clusters, meters=metrics.BrokerMetrics())
    job = make_job("j1", gpus=8).model(H100).build()
    await jobs.submit(status.JobRecord(id="j1", tenant="team-a", job=job))
    b = Broker(jobs, clusters, cluster)
    take = fitting.Take(model=H100, rack=None, from_free=8, gpus=8)
    plan = planning.CyclePlan(assignments=[planning.Assignment("j1", "east", takes=(take,))])
    assert (await jobs.dispatcher.dispatch(plan)).sent == 1
    try:
        yield b
    finally:
        await jobs.close()
        await backing.close()


async def test_a_final_report_is_acknowledged_once_committed_and_not_before(
    broker: Broker,
) -> None:
    await broker.report(State.RUNNING, seq=None)
    await broker.flush()
    broker.failing = errors.TemporaryStoreError
    await broker.report(State.SUCCEEDED, seq=7)
    await broker.flush()  # the group commit fails: the report waits, unacknowledged
    assert broker.record.status.state == State.RUNNING
    assert broker.link.acks() == []
    broker.failing = None
    await broker.flush()
    assert broker.record.status.state == State.SUCCEEDED
    assert broker.link.acks() == [(1, [7])]


async def test_a_report_that_arrives_again_is_acknowledged_without_a_change(
    broker: Broker,
) -> None:
    await broker.report(State.SUCCEEDED, seq=7)
    await broker.flush()
    events = list(broker.record.status.events)
    # the ack was lost: the agent sends it again, on this session and on its next one
    await broker.report(State.SUCCEEDED, seq=7)
    await settle()
    link = await broker.reconnect(epoch=2)
    await broker.report(State.SUCCEEDED, seq=7, session=2)
    await settle()
    assert broker.record.status.events == events
    assert [e.state for e in events].count(State.SUCCEEDED) == 1
    assert link.acks() == [(2, [7])]


async def test_an_ack_of_a_session_that_ended_is_not_sent(broker: Broker) -> None:
    broker.failing = errors.TemporaryStoreError
    await broker.report(State.SUCCEEDED, seq=7)
    old = broker.link
    new = await broker.reconnect(epoch=2)  # a new session (maybe a new agent process)
    broker.failing = None
    await broker.flush()
    assert broker.record.status.state == State.SUCCEEDED
    assert old.acks() == new.acks() == []  # seq 7 means nothing on session 2


async def test_a_report_whose_commit_conflicts_is_not_acknowledged(broker: Broker) -> None:
    broker.failing = errors.ConflictError
    await broker.report(State.FAILED, seq=3)
    await broker.flush()  # another writer won: the draft is dropped, the record read again
    broker.failing = None
    assert broker.record.status.state == State.DISPATCHED
    assert broker.link.acks() == []
    await broker.report(State.FAILED, seq=3)  # sent again: applied now
    await broker.flush()
    assert broker.record.status.state == State.FAILED
    assert broker.link.acks() == [(1, [3])]


async def test_an_unanswered_offer_is_withdrawn_after_the_timeout(broker: Broker) -> None:
    reports, cluster = broker.jobs.reports, broker.cluster
    sent_at = cluster.inflight["j1"].sent_at
    assert await reports.withdraw_unanswered(cluster, now=sent_at + 29) == 0
    assert broker.record.status.state == State.DISPATCHED
    assert await reports.withdraw_unanswered(cluster, now=sent_at + 31) == 1
    record = broker.record
    assert (record.status.state, record.status.cluster) == (State.QUEUED, None)
    assert record.status.events[-1].reason == transitions.OFFER_TIMEOUT
    assert record.status.reasons == ["east: the offer was not answered within 30 s"]
    assert broker.link.cancels() == [(transitions.OFFER_TIMEOUT, 1)]
    assert cluster.inflight == {}
    assert [p.excluded for p in broker.jobs.pending()] == [frozenset({"east"})]
    # the answer comes late: about an attempt moved past, its pods are cancelled
    placed = [status.PodPlacement(name="j1-worker-0", task="worker", node="n0")]
    await reports.accepted(cluster, messages.Accepted(job_id="j1", epoch=1, pods=placed))
    assert broker.link.cancels() == [(transitions.OFFER_TIMEOUT, 1), ("Stale", 1)]
    assert broker.record.status.state == State.QUEUED


async def test_an_accepted_offer_is_never_withdrawn(broker: Broker) -> None:
    cluster = broker.cluster
    placed = [status.PodPlacement(name="j1-worker-0", task="worker", node="n0")]
    await broker.jobs.reports.accepted(
        cluster, messages.Accepted(job_id="j1", epoch=1, pods=placed)
    )
    later = cluster.inflight["j1"].sent_at + 3600
    assert await broker.jobs.reports.withdraw_unanswered(cluster, now=later) == 0
    assert broker.record.status.state == State.DISPATCHED


class CountingLock(asyncio.Lock):
    def __init__(self) -> None:
        super().__init__()
        self.holds = 0

    async def acquire(self) -> Literal[True]:
        self.holds += 1
        return await super().acquire()


async def test_reports_sent_back_to_back_are_applied_in_order_under_one_hold_of_the_lock(
    broker: Broker,
) -> None:
    """While a commit holds the book (a dispatch, a group commit in flight), an agent's
    reports queue up; they are then applied in the order sent, holding the lock once."""
    book = broker.jobs.book
    lock = book.lock = CountingLock()
    placed = [status.PodPlacement(name="j1-worker-0", task="worker", node="n0")]
    batch: list[messages.Message] = [
        messages.Accepted(job_id="j1", epoch=1, pods=placed),
        messages.JobUpdate(job_id="j1", epoch=1, state=State.RUNNING),
        messages.JobUpdate(job_id="j1", epoch=1, state=State.SUCCEEDED, seq=4),
    ]
    await lock.acquire()  # a commit in flight
    applying = asyncio.create_task(broker.jobs.reports.apply(broker.cluster, batch, session=1))
    await settle()
    assert not applying.done()
    lock.release()
    await applying
    assert lock.holds == 2  # the commit's, and the batch's one
    await broker.flush()
    states = [event.state for event in broker.record.status.events]
    assert states[-3:] == [State.DISPATCHED, State.RUNNING, State.SUCCEEDED]
    assert [pod.node for pod in broker.record.status.pods] == ["n0"]
    assert broker.link.acks() == [(1, [4])]


async def test_a_rejection_in_a_batch_is_left_to_the_group_commit(broker: Broker) -> None:
    """A batch holds the lock without waiting on the store: a rejected offer is queued again
    with the next group commit, not by a commit of its own inside the batch."""
    reject = messages.Rejected(job_id="j1", epoch=1, reasons=["no room"])
    await broker.jobs.reports.apply(broker.cluster, [reject], session=1)
    assert broker.record.status.state == State.DISPATCHED  # committed: not yet
    assert broker.jobs.book.latest("j1").status.state == State.QUEUED  # type: ignore[union-attr]
    await broker.flush()
    assert broker.record.status.state == State.QUEUED
    assert broker.record.status.reasons == ["east: no room"]


async def test_one_report_that_fails_leaves_the_rest_of_its_batch_applied(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = broker.jobs.reports

    async def broken(cluster: fleet.Cluster, message: messages.Accepted) -> None:
        raise RuntimeError("a bug in one handler")

    monkeypatch.setattr(reports, "_accepted", broken)
    placed = [status.PodPlacement(name="j1-worker-0", task="worker", node="n0")]
    batch: list[messages.Message] = [
        messages.Accepted(job_id="j1", epoch=1, pods=placed),
        messages.JobUpdate(job_id="j1", epoch=1, state=State.RUNNING),
    ]
    await reports.apply(broker.cluster, batch, session=1)
    await broker.flush()
    assert broker.record.status.state == State.RUNNING
    failed = reports.meters.agent_messages_failed.labels(cluster="east", type="Accepted")
    assert failed._value.get() == 1


# ---- the broker app: a silent agent and a real one ------------------------------------------

TEAM_A = {"Authorization": "Bearer dev-team-a"}


class SilentAgent:
    """An agent of cluster h100 that says hello, sends its summary and heartbeats, and never
    answers an offer (hung on its cluster's API, say)."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client
        self.received: list[messages.Message] = []
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.ws = await self.client.ws_connect(
            "/v1/agents/connect", headers={"Authorization": "Bearer dev-agent-h100"}
        )
        await self.send(messages.Hello(cluster="h100"))
        summary = make_summary("h100", make_model_summary(H100, nodes_by_free=[0] * 8 + [2]))
        await self.send(messages.Summary(summary=summary))
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]

    async def send(self, message: messages._Msg) -> None:
        assert self.ws is not None
        await self.ws.send_str(messages.encode(message))

    async def _read(self) -> None:
        assert self.ws is not None
        async for frame in self.ws:
            self.received.append(messages.decode(frame.data))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            await self.send(messages.Heartbeat())

    def of(self, kind: type[messages._Msg]) -> list[Any]:
        return [m for m in self.received if isinstance(m, kind)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.ws is not None:
            await self.ws.close()


async def until(condition: Callable[[], object], *, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_an_offer_to_a_silent_agent_is_withdrawn_and_the_job_runs_elsewhere(
    tmp_path: Path,
) -> None:
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}",
        tokens_file=REPO / "config" / "tokens.yaml",
        heartbeat_seconds=0.2,
        offer_timeout_seconds=0.5,
    )
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    silent = SilentAgent(client)
    stop = asyncio.Event()
    agent: asyncio.Task[None] | None = None
    try:
        await silent.start()
        await until(lambda: silent.of(messages.Welcome))
        job = make_job("j", gpus=1).duration(0.2).document()
        submitted = await (await client.post("/v1/jobs", json=job, headers=TEAM_A)).json()
        job_id = submitted["id"]
        await until(lambda: silent.of(messages.Offer))
        (offer,) = silent.of(messages.Offer)
        # no answer within the timeout: the offer is withdrawn, that attempt cancelled
        await until(lambda: silent.of(messages.Cancel), timeout=5)
        (cancel,) = silent.of(messages.Cancel)
        assert (cancel.job_id, cancel.reason, cancel.attempt, cancel.epoch) == (
            job_id,
            "OfferTimeout",
            offer.attempt,
            offer.epoch,
        )
        got = await (await client.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).json()
        assert got["status"]["state"] == "Queued"
        assert got["status"]["events"][-1]["reason"] == "OfferTimeout"
        why = await (await client.get(f"/v1/jobs/{job_id}/why", headers=TEAM_A)).json()
        assert "OfferTimeout" in why["message"]

        # a real agent joins: the job runs there, as attempt 2; h100 is not offered it again
        token = tmp_path / "a100.token"
        token.write_text("dev-agent-a100\n")
        agent_settings = agent_app.AgentSettings(
            broker_url=str(client.make_url("/")),
            cluster="a100",
            token_file=token,
            nodes_file=agentbuilders.write_cluster(tmp_path),
            summary_interval_seconds=0.02,
        )
        agent = asyncio.create_task(agent_app.run_agent(agent_settings, stop=stop))
        for _ in range(250):
            got = await (await client.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).json()
            if got["status"]["state"] == "Succeeded":
                break
            await asyncio.sleep(0.04)
        assert (got["status"]["state"], got["status"]["cluster"]) == ("Succeeded", "a100")
        assert got["status"]["attempts"] == 2
        reasons = [e["reason"] for e in got["status"]["events"]]
        assert reasons.count("OfferTimeout") == 1
        assert len(silent.of(messages.Offer)) == 1
    finally:
        stop.set()
        if agent is not None:
            async with asyncio.timeout(5):
                await agent
        await silent.stop()
        await client.close()
