"""An agent whose messages wait on the broker is not silent: while the broker applies its
hello, or its session's inbox is full, the frames it sent are unread, and the watchdog must
not close the session for it (it did: in the soak, agents holding 6,000 jobs were closed
every few seconds and said hello again with all of them, which took longer still).

The broker app on loopback (aiohttp server, a WebSocket session), heartbeats every 0.2 s (a
session silent for 0.6 s is closed); the broker made slow on purpose where it applies what
the agent sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import messages, status
from broker.dispatch import connecting
from broker.jobs import reports
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
REPO = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer dev-admin"}
TEAM_A = {"Authorization": "Bearer dev-team-a"}
SLOW = 1.5  # seconds the broker takes over what it applies: 2.5 heartbeat timeouts


@contextlib.asynccontextmanager
async def started(tmp_path: Path, **options: Any) -> AsyncIterator[TestClient[Any, Any]]:
    """The broker app on loopback, heartbeats every 0.2 s, with `options` set."""
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}",
        tokens_file=REPO / "config" / "tokens.yaml",
        heartbeat_seconds=0.2,
        **options,
    )
    made = TestClient(TestServer(broker_app.create_app(settings)))
    await made.start_server()
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with started(tmp_path) as made:
        yield made


@contextlib.asynccontextmanager
async def following(
    ws: Any, *, answer: Callable[[messages.Message], messages._Msg | None] | None = None
) -> AsyncIterator[list[messages.Message]]:
    """An agent's loops on the session: what the broker sends (answered with `answer`'s
    reply, if any), and heartbeats every 50 ms."""
    received: list[messages.Message] = []

    async def read() -> None:
        async for frame in ws:
            if frame.type != WSMsgType.TEXT:
                continue
            message = messages.decode(frame.data)
            received.append(message)
            reply = answer(message) if answer is not None else None
            if reply is not None:
                await ws.send_str(messages.encode(reply))

    async def beat() -> None:
        while True:
            await ws.send_str(messages.encode(messages.Heartbeat()))
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(read()), asyncio.create_task(beat())]
    try:
        yield received
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ws.close()


def accept_at_once(message: messages.Message) -> messages._Msg | None:
    """An agent's answer to an offer: accepted, its pod on node n0."""
    if not isinstance(message, messages.Offer):
        return None
    pod = status.PodPlacement(name="p0", task="main", node="n0")
    return messages.Accepted(
        job_id=message.job_id, epoch=message.epoch, pods=[pod], attempt=message.attempt
    )


async def session(client: TestClient[Any, Any], *, jobs: int = 0) -> Any:
    ws = await client.ws_connect(
        "/v1/agents/connect", headers={"Authorization": "Bearer dev-agent-h100"}
    )
    held = [
        messages.AgentJob(job_id=f"gone-{n}", epoch=1, state=status.JobState.RUNNING)
        for n in range(jobs)
    ]
    await ws.send_str(messages.encode(messages.Hello(cluster="h100", jobs=held)))
    summary = make_summary("h100", make_model_summary(H100, nodes_by_free=[0] * 8 + [2]))
    await ws.send_str(messages.encode(messages.Summary(summary=summary)))
    return ws


async def beat_and_watch(ws: Any, *, seconds: float) -> list[str]:
    """Send heartbeats every 50 ms for `seconds`; what closed the session, if anything."""
    closed: list[str] = []

    async def read() -> None:
        async for frame in ws:
            if frame.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                break
        closed.append(f"closed: {ws.close_code} {frame.extra if ws.closed else ''}")

    reading = asyncio.create_task(read())
    try:
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline and not ws.closed:
            await ws.send_str(messages.encode(messages.Heartbeat()))
            await asyncio.sleep(0.05)
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
    return closed if ws.closed else []


async def test_an_agent_is_not_silent_while_the_broker_applies_its_hello(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    hello = reports.AgentReports.hello

    async def slow_hello(self: reports.AgentReports, *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(SLOW)
        await hello(self, *args, **kwargs)

    monkeypatch.setattr(reports.AgentReports, "hello", slow_hello)
    ws = await session(client, jobs=3)
    assert await beat_and_watch(ws, seconds=SLOW + 1.0) == []
    listed = await (await client.get("/v1/clusters", headers=ADMIN)).json()
    (h100,) = [c for c in listed["items"] if c["name"] == "h100"]
    assert h100["health"] != "Unreachable"
    await ws.close()


async def test_an_agent_is_not_silent_while_its_messages_wait_in_a_full_inbox(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connecting, "INBOX_MESSAGES", 4)
    apply = reports.AgentReports.apply
    applied: list[int] = []

    async def slow_apply(self: reports.AgentReports, cluster: Any, run: Any, **kw: Any) -> None:
        await asyncio.sleep(SLOW)
        await apply(self, cluster, run, **kw)
        applied.append(len(run))

    monkeypatch.setattr(reports.AgentReports, "apply", slow_apply)
    ws = await session(client)
    for n in range(12):  # reports of jobs the broker does not know: applied, slowly
        update = messages.JobUpdate(job_id=f"x{n}", epoch=1, state=status.JobState.RUNNING)
        await ws.send_str(messages.encode(update))
    assert await beat_and_watch(ws, seconds=SLOW + 1.0) == []
    assert applied  # the broker was behind, and working through them
    await ws.close()


async def test_an_agent_that_stops_sending_is_still_taken_for_silent(
    client: TestClient[Any, Any],
) -> None:
    ws = await session(client)
    assert await beat_and_watch(ws, seconds=0.5) == []
    async with asyncio.timeout(5):
        frame = await ws.receive()
        while frame.type not in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            frame = await ws.receive()
    assert ws.close_code == 4000  # heartbeat timeout


async def test_an_agent_is_sent_at_most_its_window_of_offers_unanswered(tmp_path: Path) -> None:
    """--max-offers-in-flight 3, an agent that answers nothing: 3 offers of 8 jobs go out; the
    others wait, told ClusterBusy; one answer lets one more go."""
    async with started(tmp_path, max_offers_in_flight=3) as made:
        ws = await session(made)
        async with following(ws) as received:
            ids = []
            for n in range(8):
                body = make_job(f"j{n}", gpus=1).document()
                answer = await made.post("/v1/jobs", json=body, headers=TEAM_A)
                ids.append((await answer.json())["id"])

            def offers() -> list[messages.Offer]:
                return [m for m in received if isinstance(m, messages.Offer)]

            async with asyncio.timeout(10):
                while len(offers()) < 3:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(1.0)  # cycles come and go: no more offers
            assert len(offers()) == 3
            waiting = [i for i in ids if i not in {o.job_id for o in offers()}]
            why = await (await made.get(f"/v1/jobs/{waiting[0]}/why", headers=TEAM_A)).json()
            assert "ClusterBusy" in str(why), why
            first = offers()[0]
            reject = messages.Rejected(
                job_id=first.job_id, epoch=first.epoch, reasons=["no"], attempt=first.attempt
            )
            await ws.send_str(messages.encode(reject))
            async with asyncio.timeout(10):
                while len(offers()) < 4:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)
            assert len(offers()) == 4


async def test_answers_waiting_on_the_broker_free_the_agents_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-offers-in-flight 3, an agent that accepts at once, a broker that takes 1.5 s to
    apply each run of answers: the window counts what the agent has not answered, so offers
    keep going out while its answers wait in the broker's inbox (the broker's lag held every
    window full in the soak, and cost a fifth of its throughput)."""
    apply = reports.AgentReports.apply
    applied: list[str] = []

    async def slow_apply(self: reports.AgentReports, cluster: Any, run: Any, **kw: Any) -> None:
        await asyncio.sleep(SLOW)
        await apply(self, cluster, run, **kw)
        applied.extend(m.job_id for m in run)

    monkeypatch.setattr(reports.AgentReports, "apply", slow_apply)
    async with started(tmp_path, max_offers_in_flight=3) as made:
        ws = await session(made)
        async with following(ws, answer=accept_at_once) as received:
            for n in range(8):
                body = make_job(f"j{n}", gpus=1).document()
                assert (await made.post("/v1/jobs", json=body, headers=TEAM_A)).status == 202
            async with asyncio.timeout(SLOW - 0.3):
                while len([m for m in received if isinstance(m, messages.Offer)]) < 8:
                    await asyncio.sleep(0.02)
            assert not applied  # every answer still waits on the broker
            async with asyncio.timeout(4 * SLOW):
                while len(applied) < 8:
                    await asyncio.sleep(0.05)
            listed = await (await made.get("/v1/jobs", headers=TEAM_A)).json()
            assert {job["status"]["state"] for job in listed["items"]} == {"Dispatched"}
            assert len([m for m in received if isinstance(m, messages.Offer)]) == 8


async def test_an_offer_answered_is_not_overdue_while_its_answer_waits_on_the_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--offer-timeout 0.5 s; the agent accepts at once, and the broker takes 1.5 s to apply
    the answer: the offer is not withdrawn (it was, and the job ran again)."""
    apply = reports.AgentReports.apply

    async def slow_apply(self: reports.AgentReports, cluster: Any, run: Any, **kw: Any) -> None:
        if any(isinstance(m, messages.Accepted) for m in run):
            await asyncio.sleep(SLOW)
        await apply(self, cluster, run, **kw)

    monkeypatch.setattr(reports.AgentReports, "apply", slow_apply)
    async with started(tmp_path, offer_timeout_seconds=0.5) as made:
        ws = await session(made)
        async with following(ws, answer=accept_at_once) as received:
            body = make_job("j", gpus=1).document()
            answer = await made.post("/v1/jobs", json=body, headers=TEAM_A)
            job_id = (await answer.json())["id"]
            await asyncio.sleep(SLOW + 1.5)
            got = await (await made.get(f"/v1/jobs/{job_id}", headers=TEAM_A)).json()
            reasons = [event["reason"] for event in got["status"]["events"]]
            assert "OfferTimeout" not in reasons, reasons
            assert not [m for m in received if isinstance(m, messages.Cancel)]
            assert len([m for m in received if isinstance(m, messages.Offer)]) == 1


async def test_offers_that_time_out_halve_the_agents_window(tmp_path: Path) -> None:
    """--max-offers-in-flight 40, --offer-timeout 2 s, an agent that answers nothing, 80 jobs
    queued before it connects: 40 offers go out and time out, which halves the window once;
    then 20 of the other 40 jobs go (the withdrawn wait for a newer summary), no more, and
    the window is exported."""
    options = {"max_offers_in_flight": 40, "offer_timeout_seconds": 2.0}
    async with started(tmp_path, **options) as made:
        for n in range(80):
            body = make_job(f"j{n}", gpus=1).document()
            assert (await made.post("/v1/jobs", json=body, headers=TEAM_A)).status == 202
        ws = await session(made)
        roomy = make_model_summary(H100, nodes_by_free=[0] * 8 + [10])  # 80 GPUs free
        await ws.send_str(messages.encode(messages.Summary(summary=make_summary("h100", roomy))))
        async with following(ws) as received:

            def offers() -> list[messages.Offer]:
                return [m for m in received if isinstance(m, messages.Offer)]

            def cancels() -> list[messages.Cancel]:
                return [m for m in received if isinstance(m, messages.Cancel)]

            async with asyncio.timeout(10):
                while len(cancels()) < 40:  # each withdrawn offer's attempt is cancelled
                    await asyncio.sleep(0.02)
            assert {c.reason for c in cancels()} == {"OfferTimeout"}
            withdrawn = {c.job_id for c in cancels()}
            async with asyncio.timeout(10):
                while len(offers()) < 60:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # cycles come and go, under the timeout: no more
            assert len(offers()) == 60
            assert not withdrawn & {o.job_id for o in offers()[40:]}
            text = await (await made.get("/metrics", headers=ADMIN)).text()
            assert 'gpufed_agent_offer_window{cluster="h100"} 20.0' in text
