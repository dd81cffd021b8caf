"""The real member agent (run_agent, simulated backend) against a test server that plays the
broker's side of the session protocol: hello, welcome, summaries, offers, cancels, job
updates, heartbeats and reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from broker.api import messages, status
from member_agent import app
from member_agent.cluster.simulated import backend as simulated
from tests import agentbuilders, fakebroker

TOKEN = fakebroker.TOKEN
FakeBroker = fakebroker.FakeBroker
Agent = fakebroker.Agent


@pytest.fixture
async def broker() -> AsyncIterator[tuple[FakeBroker, TestServer]]:
    fake = FakeBroker()
    server = TestServer(fake.app)
    await server.start_server()
    yield fake, server
    await server.close()


@pytest.fixture
async def agent(tmp_path: Path, broker: tuple[FakeBroker, TestServer]) -> AsyncIterator[Agent]:
    _, server = broker
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    nodes = agentbuilders.write_cluster(tmp_path)
    settings = app.AgentSettings(
        broker_url=str(server.make_url("/")),
        cluster="small",
        token_file=token_file,
        nodes_file=nodes,
        backoff=app.BackoffSettings(initial_seconds=0.05, max_seconds=0.2, auth_retry_seconds=0.3),
        summary_interval_seconds=0.02,
        failure_grace_seconds=0,
    )
    backend = simulated.SimulatedBackend("small", simulated.load_pools(nodes), start_delay=0.05)
    running = Agent(settings, backend, token_file)
    running.start()
    yield running
    await running.stop()
    await backend.close()


def offer(broker: FakeBroker, job_id: str, **job: object) -> messages.Offer:
    return agentbuilders.make_offer(job_id, agentbuilders.make_job(**job), epoch=broker.epoch)  # type: ignore[arg-type]


async def test_hello_welcome_then_a_full_summary(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    hello = await fake.wait_for_hellos(1)
    assert (hello.cluster, hello.jobs) == ("small", [])
    summary = await fake.expect(messages.Summary)
    assert summary.full
    assert summary.summary.cluster == "small"
    assert {(m.model, m.free_gpus) for m in summary.summary.models} == {
        (agentbuilders.H100, 16),
        (agentbuilders.L4, 4),
    }


async def test_offers_go_to_nodes_with_room_and_run_to_success(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    await fake.send(offer(fake, "first", gpus=8, model=agentbuilders.H100))
    first = await fake.expect(messages.Accepted)
    await fake.send(offer(fake, "second", gpus=8, model=agentbuilders.H100, duration=0.2))
    second = await fake.expect(messages.Accepted)
    assert first.job_id == "first" and second.job_id == "second"
    assert second.epoch == fake.epoch
    # the second whole node is the one that still had room
    assert {first.pods[0].node, second.pods[0].node} == {"h100-000", "h100-001"}
    pods = agent.backend.pods_of("second")
    assert [p.name for p in pods] == ["second-worker-0"]
    running = await fake.expect(messages.JobUpdate, lambda u: u.job_id == "second")
    assert (running.state, running.epoch) == (status.JobState.RUNNING, fake.epoch)
    done = await fake.expect(messages.JobUpdate, lambda u: u.job_id == "second")
    assert (done.state, done.reason) == (status.JobState.SUCCEEDED, "AllPodsSucceeded")
    assert [p.phase for p in done.pods] == [status.PodPhase.SUCCEEDED]
    # the broker hears that the GPUs are free again
    await fake.expect(
        messages.Summary,
        lambda s: any(m.model == agentbuilders.H100 and m.free_gpus == 8 for m in s.summary.models),
    )


async def test_an_offer_that_does_not_fit_is_rejected_having_created_nothing(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    await fake.send(offer(fake, "huge", gpus=8, replicas=3, model=agentbuilders.H100))
    rejected = await fake.expect(messages.Rejected)
    assert rejected.job_id == "huge" and rejected.reasons
    assert agent.backend.pods() == []
    stale = offer(fake, "stale", gpus=1)
    stale.epoch -= 1
    await fake.send(stale)
    rejected = await fake.expect(messages.Rejected)
    assert rejected.reasons == [f"stale epoch {fake.epoch - 1}: this session is {fake.epoch}"]
    assert agent.backend.pods() == []


async def test_cancel_deletes_the_pods(broker: tuple[FakeBroker, TestServer], agent: Agent) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    await fake.send(offer(fake, "job", gpus=2, replicas=2))
    await fake.expect(messages.Accepted)
    await fake.send(
        messages.Cancel(job_id="job", epoch=fake.epoch, reason="UserCancelled", grace_seconds=1)
    )
    cancelled = await fake.expect(
        messages.JobUpdate, lambda u: u.state == status.JobState.CANCELLED
    )
    assert cancelled.reason == "UserCancelled"
    assert agent.backend.pods() == []
    await fake.send(messages.Cancel(job_id="never-seen", epoch=fake.epoch, reason="Gone"))
    unknown = await fake.expect(messages.JobUpdate, lambda u: u.job_id == "never-seen")
    assert (unknown.state, unknown.reason) == (status.JobState.CANCELLED, "Gone")


async def test_a_message_that_does_not_decode_is_ignored(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    assert fake.ws is not None
    await fake.ws.send_str("not json")
    await fake.ws.send_str('{"type": "offer", "job_id": "x"}')
    await fake.send(offer(fake, "ok", gpus=1))
    accepted = await fake.expect(messages.Accepted)
    assert accepted.job_id == "ok"
    assert len(fake.hellos) == 1  # the same session


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("drop", id="the broker drops the connection"),
        pytest.param("silence", id="the broker goes silent"),
    ],
)
async def test_the_agent_reconnects_and_says_hello_with_its_jobs(
    broker: tuple[FakeBroker, TestServer], agent: Agent, how: str
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    await fake.send(offer(fake, "long", gpus=4))
    await fake.expect(messages.Accepted)
    await fake.expect(messages.JobUpdate, lambda u: u.state == status.JobState.RUNNING)
    old = fake.ws
    assert old is not None
    if how == "drop":
        await old.close()
    else:
        fake.silent = True  # three heartbeats (0.6 s) without a word
    hello = await fake.wait_for_hellos(2)
    fake.silent = False
    assert [(j.job_id, j.state) for j in hello.jobs] == [("long", status.JobState.RUNNING)]
    assert [p.phase for p in hello.jobs[0].pods] == [status.PodPhase.RUNNING]
    summary = await fake.expect(messages.Summary)
    assert summary.full
    # the new session works under its new epoch
    await fake.send(offer(fake, "after", gpus=1))
    accepted = await fake.expect(messages.Accepted)
    assert (accepted.job_id, accepted.epoch) == ("after", fake.epoch)


async def test_a_job_that_ends_while_disconnected_is_in_the_next_hello(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    fake.token = "rotated"  # keep the agent out for a while
    await fake.send(offer(fake, "short", gpus=1, duration=0.2))
    await fake.expect(messages.Accepted)
    assert fake.ws is not None
    await fake.ws.close()
    await asyncio.sleep(0.8)  # "short" succeeds meanwhile
    fake.token = TOKEN
    hello = await fake.wait_for_hellos(2)
    assert [(j.job_id, j.state) for j in hello.jobs] == [("short", status.JobState.SUCCEEDED)]


async def test_a_restarted_agent_says_hello_with_the_jobs_its_pods_still_run(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    await fake.send(offer(fake, "long", gpus=8, replicas=2, model=agentbuilders.H100))
    await fake.expect(messages.Accepted)
    await fake.expect(messages.JobUpdate, lambda u: u.state == status.JobState.RUNNING)
    epoch = fake.epoch
    await agent.stop()
    agent.start()  # a new agent, an empty job table: the cluster's pods still run
    hello = await fake.wait_for_hellos(2)
    assert [(j.job_id, j.epoch, j.state) for j in hello.jobs] == [
        ("long", epoch, status.JobState.RUNNING)
    ]
    assert sorted(p.name for p in hello.jobs[0].pods) == ["long-worker-0", "long-worker-1"]
    assert agent.backend.creates == 2
    # the broker moved it elsewhere meanwhile: it cancels the stale copy, the pods go
    await fake.send(messages.Cancel(job_id="long", epoch=fake.epoch, reason="Stale"))
    cancelled = await fake.expect(messages.JobUpdate, lambda u: u.job_id == "long")
    assert (cancelled.state, cancelled.reason) == (status.JobState.CANCELLED, "Stale")
    assert agent.backend.pods() == []


async def test_a_refused_token_is_retried_slowly_until_it_is_fixed(
    broker: tuple[FakeBroker, TestServer], agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    fake.token = "rotated"
    assert fake.ws is not None
    await fake.ws.close()
    await asyncio.sleep(0.5)
    refused = fake.attempts - 1
    # retried every ~0.3 s, not at the 0.05 s backoff
    assert 1 <= refused <= 3
    assert any("refused cluster small" in r.getMessage() for r in caplog.records)
    agent.token_file.write_text("rotated\n")
    await fake.wait_for_hellos(2)


async def test_stop_closes_the_session(
    broker: tuple[FakeBroker, TestServer], tmp_path: Path
) -> None:
    fake, server = broker
    (tmp_path / "token").write_text(TOKEN)
    settings = app.AgentSettings(
        broker_url=str(server.make_url("/")),
        cluster="small",
        token_file=tmp_path / "token",
        nodes_file=agentbuilders.write_cluster(tmp_path),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(app.run_agent(settings, stop=stop))
    await fake.wait_for_hellos(1)
    stop.set()
    async with asyncio.timeout(5):
        await task
    assert fake.ws is not None
    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(1):
            while not fake.ws.closed:
                await asyncio.sleep(0.01)
    assert fake.ws.closed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_metrics_and_health_are_served(
    broker: tuple[FakeBroker, TestServer], tmp_path: Path
) -> None:
    fake, server = broker
    (tmp_path / "token").write_text(TOKEN)
    port = free_port()
    settings = app.AgentSettings(
        broker_url=str(server.make_url("/")),
        cluster="small",
        token_file=tmp_path / "token",
        nodes_file=agentbuilders.write_cluster(tmp_path),
        metrics_port=port,
        metrics_host="127.0.0.1",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(app.run_agent(settings, stop=stop))
    try:
        await fake.wait_for_hellos(1)
        await fake.send(offer(fake, "one", gpus=2))
        await fake.expect(messages.Accepted)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                assert await response.json() == {"status": "ok", "connected": True}
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                text = await response.text()
        assert 'gpufed_agent_session_connected{cluster="small"} 1.0' in text
        assert 'gpufed_agent_offers_total{cluster="small",result="accepted"} 1.0' in text
        # one job, with its pod pending or already running
        assert re.search(
            r'gpufed_agent_jobs\{cluster="small",state="(Dispatched|Running)"\} 1.0', text
        )
        assert re.search(
            r'gpufed_agent_pods\{cluster="small",phase="(Pending|Running)"\} 1.0', text
        )
    finally:
        stop.set()
        async with asyncio.timeout(5):
            await task


async def test_stop_does_not_wait_for_a_welcome_that_never_comes(tmp_path: Path) -> None:
    async def mute(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:  # reads the hello, never answers
            pass
        return ws

    mute_app = web.Application()
    mute_app.router.add_get("/v1/agents/connect", mute)
    server = TestServer(mute_app)
    await server.start_server()
    settings = app.AgentSettings(
        broker_url=str(server.make_url("/")),
        cluster="small",
        nodes_file=agentbuilders.write_cluster(tmp_path),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(app.run_agent(settings, stop=stop))
    await asyncio.sleep(0.3)
    stop.set()
    async with asyncio.timeout(1):
        await task
    await server.close()


async def test_a_final_report_is_sent_on_every_session_until_acknowledged(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    await fake.wait_for_hellos(1)
    await fake.send(offer(fake, "short", gpus=1, duration=0.1))
    done = await fake.expect(messages.JobUpdate, lambda u: u.state.terminal)
    assert (done.state, done.seq) == (status.JobState.SUCCEEDED, 1)
    # no ack (the broker went down before committing it): the next session has it again
    assert fake.ws is not None
    await fake.ws.close()
    hello = await fake.wait_for_hellos(2)
    assert [(j.job_id, j.state) for j in hello.jobs] == [("short", status.JobState.SUCCEEDED)]
    again = await fake.expect(messages.JobUpdate, lambda u: u.state.terminal)
    assert (again.job_id, again.state, again.seq) == ("short", status.JobState.SUCCEEDED, 1)
    # an ack for another session changes nothing; one for this session is the end of it
    await fake.send(messages.Ack(epoch=fake.epoch - 1, seqs=[1]))
    await fake.ws.close()
    hello = await fake.wait_for_hellos(3)
    assert [j.job_id for j in hello.jobs] == ["short"]
    await fake.expect(messages.JobUpdate, lambda u: u.seq == 1)
    await fake.send(messages.Ack(epoch=fake.epoch, seqs=[1]))
    await fake.send(offer(fake, "marker", gpus=1))  # the ack was read before this answer
    await fake.expect(messages.Accepted, lambda a: a.job_id == "marker")
    await fake.ws.close()
    hello = await fake.wait_for_hellos(4)
    assert [j.job_id for j in hello.jobs] == ["marker"]
    await fake.send(offer(fake, "marker2", gpus=1))
    await fake.expect(messages.Accepted, lambda a: a.job_id == "marker2")
    since = fake.log[fake.log.index(hello) :]
    assert not [m for m in since if isinstance(m, messages.JobUpdate) and m.job_id == "short"]


async def test_a_broker_without_acks_gets_no_seq_and_a_written_report_counts(
    broker: tuple[FakeBroker, TestServer], agent: Agent
) -> None:
    fake, _ = broker
    fake.version = 1
    await fake.wait_for_hellos(1)
    assert fake.ws is not None
    await fake.ws.close()  # the agent reconnects to the broker of protocol 1
    await fake.wait_for_hellos(2)
    await fake.send(offer(fake, "short", gpus=1, duration=0.1))
    done = await fake.expect(messages.JobUpdate, lambda u: u.state.terminal)
    assert (done.job_id, done.seq) == ("short", None)
    await fake.ws.close()
    hello = await fake.wait_for_hellos(3)
    assert hello.jobs == []


async def test_cluster_labels_reach_a_broker_of_protocol_5_only(
    tmp_path: Path, broker: tuple[FakeBroker, TestServer]
) -> None:
    fake, server = broker
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    nodes = agentbuilders.write_cluster(tmp_path)
    settings = app.AgentSettings(
        broker_url=str(server.make_url("/")),
        cluster="small",
        cluster_labels={"region": "eu-west", "tier": "spot"},
        token_file=token_file,
        nodes_file=nodes,
        backoff=app.BackoffSettings(initial_seconds=0.05, max_seconds=0.2, auth_retry_seconds=0.3),
    )
    backend = simulated.SimulatedBackend("small", simulated.load_pools(nodes), start_delay=0.05)
    running = Agent(settings, backend, token_file)
    running.start()
    try:
        await fake.wait_for_hellos(1)
        summary = await fake.expect(messages.Summary)
        assert summary.summary.labels == {"region": "eu-west", "tier": "spot"}
        fake.version = messages.LABELS_SINCE - 1  # an older broker: it forbids the field
        assert fake.ws is not None
        await fake.ws.close()
        await fake.wait_for_hellos(2)
        summary = await fake.expect(messages.Summary)
        assert summary.summary.labels == {}
    finally:
        await running.stop()
        await backend.close()
