"""Several broker replicas on one real etcd, in one process: one leader, fenced by its term;
every replica serves the API from its watch-fed cache; agents follow the leader.

Each test has an etcd server of its own (the broker's keys are fixed: /gpufed/...).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import messages, status
from broker.jobs import book, watching
from broker.state import electing, errors, etcd, opening, records, store
from tests.builders import make_job, make_model_summary, make_summary

pytestmark = pytest.mark.etcd

TEAM_A = {"Authorization": "Bearer dev-team-a"}
ADMIN = {"Authorization": "Bearer dev-admin"}
AGENT = {"Authorization": "Bearer dev-agent-h100"}
REPO = Path(__file__).resolve().parents[2]
H100 = "NVIDIA-H100-80GB-HBM3"
Client = TestClient[Any, Any]


class Replicas:
    """Broker apps on one etcd, each a TestClient; `start(n)`, `leader()`, `close(i)`."""

    def __init__(self, url: str, *, lease: int = 2) -> None:
        self.url = url
        self.lease = lease
        self.clients: list[Client] = []

    async def start(self, count: int) -> list[Client]:
        for _ in range(count):
            index = len(self.clients)
            settings = broker_app.BrokerSettings(
                store=self.url,
                tokens_file=REPO / "config" / "tokens.yaml",
                replica_id=f"replica-{index}",
                advertise_url=f"http://replica-{index}.test",
                leader_lease_seconds=self.lease,
            )
            client = TestClient(TestServer(broker_app.create_app(settings)))
            await client.start_server()
            self.clients.append(client)
        return self.clients[-count:]

    async def status(self, client: Client) -> dict[str, Any]:
        response = await client.get("/v1/status")
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body

    async def leader(self, *, timeout: float = 10.0, among: list[Client] | None = None) -> Client:
        """The replica whose leader work runs, once every replica of `among` names it."""
        deadline = time.monotonic() + timeout
        among = among or self.clients
        while time.monotonic() < deadline:
            answers = [await self.status(c) for c in among]
            named = {a["leader"] for a in answers}
            for client, answer in zip(among, answers, strict=True):
                synced = all(a["synced"] for a in answers)
                if answer["active"] and named == {answer["url"]} and synced:
                    return client
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no leader: {[await self.status(c) for c in among]}")

    def followers(self, leader: Client) -> list[Client]:
        return [c for c in self.clients if c is not leader]

    async def close(self, client: Client) -> None:
        await client.close()
        self.clients.remove(client)

    async def close_all(self) -> None:
        for client in list(self.clients):
            await client.close()
        self.clients.clear()


@pytest.fixture
async def replicas(etcd_url: str) -> AsyncIterator[Replicas]:
    group = Replicas(etcd_url)
    try:
        yield group
    finally:
        await group.close_all()


async def submit(client: Client, doc: dict[str, Any], **headers: str) -> Any:
    body = io.BytesIO(json.dumps(doc).encode())
    return await client.post("/v1/jobs", data=body, headers={**TEAM_A, **headers})


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the condition did not hold in time")


class FakeAgent:
    """The agent of cluster h100 over a real WebSocket: hello, a full summary, then it
    accepts every offer and records what the broker sends."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.received: list[messages.Message] = []
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        self.ws = await self.client.ws_connect("/v1/agents/connect", headers=AGENT)
        await self.ws.send_str(messages.encode(messages.Hello(cluster="h100")))
        summary = make_summary("h100", make_model_summary(H100, nodes_by_free=[0] * 8 + [4]))
        await self.ws.send_str(messages.encode(messages.Summary(summary=summary)))
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.ws is not None
        async for frame in self.ws:
            if frame.type != aiohttp.WSMsgType.TEXT:
                continue
            message = messages.decode(frame.data)
            self.received.append(message)
            if isinstance(message, messages.Offer):
                pods = [status.PodPlacement(name=f"{message.job_id}-0", task="worker", node="n0")]
                accepted = messages.Accepted(
                    job_id=message.job_id,
                    epoch=message.epoch,
                    pods=pods,
                    attempt=message.attempt,
                )
                await self.ws.send_str(messages.encode(accepted))

    def got(self, kind: type[messages._Msg], job_id: str) -> bool:
        return any(
            isinstance(m, kind) and getattr(m, "job_id", None) == job_id for m in self.received
        )

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def state_of(client: Client, job_id: str) -> str:
    body = await (await client.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).json()
    return str(body["status"]["state"])


# ---- one leader, and everyone agrees ------------------------------------------------------


async def test_three_replicas_elect_one_leader_and_agree_on_it(replicas: Replicas) -> None:
    await replicas.start(3)
    leader = await replicas.leader()
    answers = [await replicas.status(c) for c in replicas.clients]
    assert [a["role"] for a in answers].count("leader") == 1
    assert {(a["leader"], a["term"]) for a in answers} == {
        (answers[0]["leader"], answers[0]["term"])
    }
    assert answers[0]["term"] >= 1 and all(a["synced"] for a in answers)
    metrics = await (await leader.get("/metrics", headers=ADMIN)).text()
    assert "gpufed_broker_leader 1.0" in metrics
    for follower in replicas.followers(leader):
        scraped = await (await follower.get("/metrics", headers=ADMIN)).text()
        assert "gpufed_broker_leader 0.0" in scraped
        assert (await follower.get("/readyz")).status == 200


async def test_a_follower_refuses_agents_with_the_leaders_url(replicas: Replicas) -> None:
    await replicas.start(2)
    leader = await replicas.leader()
    [follower] = replicas.followers(leader)
    response = await follower.get("/v1/agents/connect", headers=AGENT)
    assert response.status == 409
    assert response.headers["Retry-After"] == "1"
    problem = await response.json(content_type=None)
    assert problem["type"] == "urn:gpufed:problem:not-leader"
    assert problem["leader"] == (await replicas.status(leader))["url"]
    agent = FakeAgent(leader)  # the leader takes the session
    await agent.connect()
    await eventually(lambda: _cluster_health(leader, "Ready"))
    await agent.close()


async def _cluster_health(client: Client, health: str) -> bool:
    items = (await (await client.get("/v1/clusters", headers=ADMIN)).json())["items"]
    return any(item["name"] == "h100" and item["health"] == health for item in items)


# ---- the API on any replica ---------------------------------------------------------------


async def test_a_submit_retried_on_another_replica_with_its_key_returns_the_same_job(
    replicas: Replicas,
) -> None:
    a, b = await replicas.start(2)
    for i in range(100):  # measured before: 100 of 100 were 500
        doc = make_job(f"retried-{i}", gpus=1).document()
        first = await submit(a, doc, **{"Idempotency-Key": f"key-{i}"})
        again = await submit(b, doc, **{"Idempotency-Key": f"key-{i}"})
        assert (first.status, again.status) == (202, 202), await again.text()
        assert (await first.json())["id"] == (await again.json())["id"]
        assert again.headers["Idempotent-Replayed"] == "true"


async def test_a_submitter_reads_its_write_on_another_replica(replicas: Replicas) -> None:
    a, b = await replicas.start(2)
    for i in range(20):
        job_id = (await (await submit(a, make_job(f"mine-{i}").document())).json())["id"]
        got = await b.get(f"/v1/jobs/{job_id}", headers=TEAM_A)
        assert got.status == 200, await got.text()
    missing = await b.get("/v1/jobs/nothing-here", headers=TEAM_A)
    assert missing.status == 404


async def test_a_job_submitted_to_a_follower_is_dispatched_by_the_leader_and_cancelled_there(
    replicas: Replicas,
) -> None:
    await replicas.start(2)
    leader = await replicas.leader()
    [follower] = replicas.followers(leader)
    agent = FakeAgent(leader)
    await agent.connect()
    try:
        await eventually(lambda: _cluster_health(follower, "Ready"))  # the published view
        job_id = (await (await submit(follower, make_job("via-follower").document())).json())["id"]
        await eventually(lambda: asyncio.sleep(0, agent.got(messages.Offer, job_id)))
        await eventually(lambda: _has_pods(follower, job_id))

        cancelled = await follower.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)
        assert cancelled.status == 202
        # the follower committed it; the leader, watching, sends the agent the Cancel
        await eventually(lambda: asyncio.sleep(0, agent.got(messages.Cancel, job_id)))
        [cancel] = [m for m in agent.received if isinstance(m, messages.Cancel)]
        assert (cancel.reason, cancel.attempt) == ("Cancelled", 1)
    finally:
        await agent.close()


async def _has_pods(client: Client, job_id: str) -> bool:
    body = await (await client.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).json()
    return bool(body["status"]["pods"])


# ---- handover ----------------------------------------------------------------------------


async def test_a_leader_that_shuts_down_hands_over_within_two_seconds(replicas: Replicas) -> None:
    await replicas.start(3)
    leader = await replicas.leader()
    term = (await replicas.status(leader))["term"]
    started = time.monotonic()
    await replicas.close(leader)  # SIGTERM's path: on_shutdown resigns (lease revoked)
    successor = await replicas.leader(timeout=5.0)
    took = time.monotonic() - started
    assert took < 2.0, f"handover took {took:.2f} s"
    assert (await replicas.status(successor))["term"] > term
    # and it dispatches: an agent connects to it and gets an offer for a new job
    agent = FakeAgent(successor)
    await agent.connect()
    try:
        await eventually(lambda: _cluster_health(successor, "Ready"))
        follower = replicas.followers(successor)[0]
        job_id = (await (await submit(follower, make_job("after").document())).json())["id"]
        await eventually(lambda: asyncio.sleep(0, agent.got(messages.Offer, job_id)))
    finally:
        await agent.close()


# ---- fencing ------------------------------------------------------------------------------


async def test_a_deposed_leaders_commit_is_refused_and_it_steps_down(etcd_url: str) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    election = electing.Election(backing, replica="old", url="http://old", ttl=5)
    running = asyncio.create_task(election.run())
    try:
        await asyncio.wait_for(election.leading.wait(), 5)
        jobs = book.JobBook(records.JobStore(backing), leadership=election)
        record = status.JobRecord(id="fenced-1", tenant="team-a", job=make_job("fenced").build())
        record.record(status.JobState.QUEUED, "Submitted")
        await jobs.create(record)  # a submit: not fenced
        draft = jobs.draft("fenced-1")
        assert draft is not None
        draft.record(status.JobState.QUEUED, "Decided", "by the old leader")

        # another replica takes the leader key under it (its lease lost, say)
        entry = await backing.get(electing.LEADER_KEY)
        assert entry is not None
        await backing.commit(
            store.Txn(
                compares=[store.Compare(electing.LEADER_KEY, entry.mod_revision)],
                puts=[(electing.LEADER_KEY, electing.encode_leader("new", "http://new", 2))],
            )
        )
        with pytest.raises(errors.NotLeaderError):
            await jobs.commit([draft])

        assert not election.is_leader  # it stepped down at once
        stored = await records.JobStore(backing).get("fenced-1")
        assert stored is not None and stored.record.status.events[-1].reason == "Submitted"
        with pytest.raises(errors.NotLeaderError):  # and decides nothing more
            await jobs.commit([draft])
        cancel = jobs.draft("fenced-1")
        assert cancel is not None
        cancel.status.cancel_requested = True
        await jobs.commit([cancel], fenced=False)  # a cancel, as any replica takes it
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await backing.close()


async def test_the_term_grows_with_each_new_leader(etcd_url: str) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    terms = []
    try:
        for name in ("a", "b", "c"):
            election = electing.Election(backing, replica=name, url=f"http://{name}", ttl=5)
            task = asyncio.create_task(election.run())
            await asyncio.wait_for(election.leading.wait(), 5)
            terms.append(election.term)
            await election.resign()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert terms == sorted(terms) and len(set(terms)) == 3
        assert await backing.get(electing.LEADER_KEY) is None  # resigning deleted it
    finally:
        await backing.close()


# ---- the watch-fed book -------------------------------------------------------------------


async def test_the_book_follows_another_replicas_writes_and_relists_after_a_compaction(
    etcd_url: str,
) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    writer = book.JobBook(records.JobStore(backing))
    reader = book.JobBook(records.JobStore(backing))
    loaded = await reader.load()
    seen: list[book.Change] = []
    reader.observe(seen.append)
    for i in range(3):
        record = status.JobRecord(id=f"w-{i}", tenant="team-a", job=make_job(f"w{i}").build())
        record.record(status.JobState.QUEUED, "Submitted")
        await writer.create(record)
    # the history the reader would watch from is compacted away: it lists again
    current = (await backing.list("/nothing"))[1]
    await backing.compact(current)
    follower = watching.BookWatch(reader, backing, replica="reader")
    task = asyncio.create_task(follower.run(loaded + 1))
    try:
        await asyncio.wait_for(follower.sync(), 5)
        assert {r.id for r in reader} == {"w-0", "w-1", "w-2"}
        assert follower.synced and all(c.remote for c in seen)
        draft = writer.draft("w-0")
        assert draft is not None
        draft.status.cancel_requested = True
        draft.record(status.JobState.QUEUED, "CancelRequested")
        held = reader.get("w-0")
        await writer.commit([draft])
        await asyncio.wait_for(follower.sync(), 5)
        got = reader.get("w-0")
        assert got is not None and got.status.cancel_requested
        assert held is not None and got.job is held.job  # the spec read once (`known`)
        assert seen[-1].before is not None and not seen[-1].before.status.cancel_requested
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await backing.close()


async def test_an_idempotency_key_from_another_replica_finds_its_job_before_the_watch_does(
    etcd_url: str,
) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    try:
        a = book.JobBook(records.JobStore(backing))
        b = book.JobBook(records.JobStore(backing))  # no watch at all
        job = make_job("keyed").build()
        record = status.JobRecord(id="keyed-1", tenant="team-a", job=job, idempotency_key="k")
        record.record(status.JobState.QUEUED, "Submitted")
        await a.create(record)
        again = status.JobRecord(id="keyed-2", tenant="team-a", job=job, idempotency_key="k")
        again.record(status.JobState.QUEUED, "Submitted")
        replayed = await b.create(again)
        assert replayed.id == "keyed-1"
        assert (await b.fetch("keyed-1")) is not None and len(b) == 1
    finally:
        await backing.close()


class CutOff:
    """A store whose lease keep-alives stop getting through (a leader cut off from etcd),
    while everything else works."""

    def __init__(self, inner: etcd.EtcdStore) -> None:
        self.inner = inner
        self.cut = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def keep_alive(self, lease: int) -> int:
        if self.cut:
            await asyncio.sleep(10)  # hangs, as a call to an unreachable member does
        return await self.inner.keep_alive(lease)


async def test_a_leader_that_cannot_renew_its_lease_stops_before_the_lease_can_end(
    etcd_url: str,
) -> None:
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(etcd_url))
    cut = CutOff(backing)
    election = electing.Election(cut, replica="cut", url="http://cut", ttl=2)  # type: ignore[arg-type]
    task = asyncio.create_task(election.run())
    try:
        await asyncio.wait_for(election.leading.wait(), 5)
        cut.cut = True
        renewed = election._renewed_at
        await asyncio.wait_for(election.following.wait(), 5)
        stopped = time.monotonic()
        # it stopped leading before the store could expire its lease (ttl after the renewal
        # sent last): no other replica could have led yet
        assert stopped < renewed + election.ttl
        with pytest.raises(errors.NotLeaderError):
            election.fence()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await backing.close()


async def test_a_change_a_follower_commits_is_told_once_by_the_leader(
    replicas: Replicas,
) -> None:
    await replicas.start(2)
    leader = await replicas.leader()
    [follower] = replicas.followers(leader)
    job_id = (await (await submit(follower, make_job("told-once").document())).json())["id"]
    assert (await follower.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 202

    async def cancelled(client: Client) -> float:
        """gpufed_jobs_finished_total{state="Cancelled"}, every queue's series added."""
        text = await (await client.get("/metrics", headers=ADMIN)).text()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("gpufed_jobs_finished_total{") and 'state="Cancelled"' in line
        )

    async def leader_counted() -> bool:
        return await cancelled(leader) == 1

    await eventually(leader_counted)
    assert await state_of(leader, job_id) == "Cancelled"
    assert await cancelled(follower) == 0
