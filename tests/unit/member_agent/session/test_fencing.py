"""The agent's self-fencing: the cluster lease lapses, the job handler stops what the broker
may run elsewhere (clusterLost: requeue), keeps what waits for its cluster, and creates nothing
until the lease is renewed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.api import messages, status
from member_agent.jobs import handling
from member_agent.session import leasing
from tests import agentbuilders
from tests.unit.member_agent import harnesses

State = status.JobState


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[harnesses.Harness]:
    h = harnesses.Harness(tmp_path)
    yield h
    await h.close()


async def running(h: harnesses.Harness, job_id: str, **job: object) -> None:
    reply = await h.offer(job_id, duration=600, **job)  # type: ignore[arg-type]
    assert isinstance(reply, messages.Accepted)
    await h.pump(lambda: (State.RUNNING.value, "PodsRunning") in h.updates(job_id))


async def test_a_fence_stops_the_requeue_jobs_and_keeps_the_waiting_ones(
    harness: harnesses.Harness,
) -> None:
    await running(harness, "req", gpus=8, replicas=2, model=agentbuilders.H100)
    await running(harness, "waits", gpus=2, model=agentbuilders.L4, cluster_lost="wait")
    harness.connected = False  # partitioned: nothing reaches the broker

    stopped = await harness.handler.fence(reason="no word for 30 s", grace_seconds=0)

    assert stopped == 1
    assert harness.backend.pods_of("req") == []
    assert [p.phase for p in harness.backend.pods_of("waits")] == [status.PodPhase.RUNNING]
    req = harness.handler.table.get("req")
    assert req is not None and (req.state, req.reason) == (State.CANCELLED, "ClusterLost")
    waits = harness.handler.table.get("waits")
    assert waits is not None and waits.state == State.RUNNING
    # the final report is kept for the next session, and hello lists the job until acked
    [pending] = harness.handler.updates.pending.values()
    assert (pending.update.job_id, pending.update.state, pending.update.reason) == (
        "req",
        State.CANCELLED,
        "ClusterLost",
    )
    assert "the agent fenced itself: no word for 30 s" in pending.update.message
    hello = {j.job_id: (j.state, j.reason) for j in harness.handler.hello_jobs()}
    assert hello == {"req": (State.CANCELLED, "ClusterLost"), "waits": (State.RUNNING, None)}


async def test_while_fenced_offers_create_nothing_and_once_renewed_they_do(
    harness: harnesses.Harness,
) -> None:
    await harness.handler.fence(reason="no word for 30 s", grace_seconds=0)
    reply = await harness.offer("late", gpus=1)
    assert isinstance(reply, messages.Rejected)
    assert reply.reasons == ["the agent fenced itself: no word for 30 s"]
    assert harness.backend.pods_of("late") == []
    assert harness.handler.offers["fenced"] == 1

    harness.handler.unfence()
    assert isinstance(await harness.offer("later", gpus=1), messages.Accepted)


async def test_a_job_adopted_after_a_restart_keeps_its_policy(tmp_path: Path) -> None:
    first = harnesses.Harness(tmp_path)
    await running(first, "waits", gpus=2, model=agentbuilders.L4, cluster_lost="wait")
    await running(first, "req", gpus=1, model=agentbuilders.H100)
    await first.handler.close()
    # the agent restarts on the same cluster: it finds the pods and their annotations
    restarted = handling.JobHandler(first.backend, send=lambda *_, **__: None)
    assert restarted.adopt(first.backend.held_jobs()) == 2
    assert await restarted.fence(reason="lapsed", grace_seconds=0) == 1
    assert first.backend.pods_of("req") == []
    assert len(first.backend.pods_of("waits")) == 1
    await first.close()


@pytest.mark.looptime
async def test_the_lease_fences_once_when_it_lapses_and_a_renewal_lifts_it() -> None:
    fences: list[tuple[str, float]] = []
    renewals: list[bool] = []

    async def fence(*, reason: str, grace_seconds: float) -> None:
        fences.append((reason, grace_seconds))

    lease = leasing.ClusterLease(
        requested=30.0,
        heartbeat=0.05,
        failure_grace=30.0,
        on_lapse=fence,
        on_renew=lambda: renewals.append(True),
        clock=asyncio.get_running_loop().time,  # the loop's fake time: the sleeps take none
    )
    # the broker's welcome: heartbeat 0.05 s, grace 1.3 s -> fence after 1.3 - 1.1 = 0.2 s
    lease.set_terms(heartbeat=0.05, lost_after=1.3)
    assert lease.fence_after == pytest.approx(0.2)
    keeping = asyncio.create_task(lease.keep())
    try:
        for _ in range(6):  # renewed in time: nothing happens
            await asyncio.sleep(0.05)
            lease.renew()
        assert fences == []
        await asyncio.sleep(0.4)
        assert len(fences) == 1 and lease.lapsed  # once, however long the silence
        reason, grace = fences[0]
        assert "no word from the broker for 0.2 s" in reason
        assert grace == pytest.approx(0.55)  # half of 1.3 - 0.2
        lease.renew()
        assert renewals == [True] and not lease.lapsed
        await asyncio.sleep(0.3)
        assert len(fences) == 2  # lapsed again
    finally:
        keeping.cancel()
