"""Offers, cancels and pod events, driven straight into the job handler (no socket)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from broker.api import messages, status
from member_agent.placement import limits
from tests import agentbuilders
from tests.unit.member_agent import harnesses


@pytest.fixture
async def harness(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = harnesses.Harness(tmp_path)
    yield h
    await h.close()


async def test_an_offer_that_fits_is_accepted_with_its_pods(harness: harnesses.Harness) -> None:
    reply = await harness.offer("j1", gpus=8, replicas=2, model=agentbuilders.H100)
    assert isinstance(reply, messages.Accepted)
    assert sorted((p.name, len(p.gpus)) for p in reply.pods) == [
        ("j1-worker-0", 8),
        ("j1-worker-1", 8),
    ]
    assert {p.node for p in reply.pods} == {"h100-000", "h100-001"}
    assert len(harness.backend.pods_of("j1")) == 2
    assert harness.changes == 1
    assert harness.handler.offers == {"accepted": 1}


@pytest.mark.parametrize(
    ("offer", "result", "reason"),
    [
        pytest.param({"epoch": 1, "session_epoch": 2}, "stale", "stale epoch 1", id="stale epoch"),
        pytest.param(
            {"gpus": 8, "replicas": 3, "model": agentbuilders.H100},
            "unplaceable",
            "",
            id="too big",
        ),
        pytest.param({"gpus": 1, "cpu": "500"}, "unplaceable", "", id="too much cpu"),
        pytest.param(
            {"gpus": 8, "namespace": "small-team"},
            "limit",
            "GPU limit 4",
            id="over the namespace limit",
        ),
    ],
)
async def test_an_offer_that_cannot_be_run_is_rejected_having_created_nothing(
    tmp_path: Path, offer: dict[str, Any], result: str, reason: str
) -> None:
    h = harnesses.Harness(
        tmp_path, agent_limits=limits.AgentLimits(namespace_gpus={"small-team": 4})
    )
    reply = await h.offer("j1", **offer)
    assert isinstance(reply, messages.Rejected)
    assert reply.reasons
    assert reason in " ".join(reply.reasons)
    assert h.backend.pods() == []
    assert h.handler.table.get("j1") is None
    assert h.handler.offers == {result: 1}
    await h.close()


async def test_the_namespace_limit_counts_running_jobs(tmp_path: Path) -> None:
    h = harnesses.Harness(tmp_path, agent_limits=limits.AgentLimits(default_namespace_gpus=12))
    assert isinstance(await h.offer("j1", gpus=8), messages.Accepted)
    assert isinstance(await h.offer("j2", gpus=4, namespace="other"), messages.Accepted)
    reply = await h.offer("j3", gpus=8)
    assert isinstance(reply, messages.Rejected)
    assert reply.reasons == [
        "namespace default: GPU limit 12 on this cluster, 8 in use, the job asks for 8"
    ]
    await h.close()


async def test_a_failed_create_rejects_the_offer_and_leaves_no_pod(
    harness: harnesses.Harness,
) -> None:
    harness.backend.fail_creates_after(1)
    reply = await harness.offer("j1", gpus=4, replicas=3)
    assert isinstance(reply, messages.Rejected)
    assert "injected create failure" in reply.reasons[0]
    assert harness.backend.pods() == []
    # the rollback's DELETED events do not touch the same job offered again
    again = await harness.offer("j1", gpus=4, replicas=3)
    assert isinstance(again, messages.Accepted)
    await harness.pump(lambda: harness.updates("j1") == [("Running", "PodsRunning")])


async def test_a_resent_offer_is_answered_with_the_same_pods(harness: harnesses.Harness) -> None:
    first = await harness.offer("j1", gpus=2)
    second = await harness.offer("j1", gpus=2, epoch=2, session_epoch=2)
    assert isinstance(first, messages.Accepted)
    assert isinstance(second, messages.Accepted)
    assert second.pods == first.pods
    assert second.epoch == 2
    assert len(harness.backend.pods()) == 1


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        pytest.param(
            {"gpus": 2, "replicas": 2, "duration": 0.02},
            [("Running", "PodsRunning"), ("Succeeded", "AllPodsSucceeded")],
            id="runs then succeeds",
        ),
        pytest.param(
            {"gpus": 2, "replicas": 2, "duration": 0.02, "outcome": "Failed:OOMKilled"},
            [("Running", "PodsRunning"), ("Failed", "OOMKilled")],
            id="a pod is OOM killed",
        ),
        pytest.param(
            {"gpus": 1, "replicas": 3, "min_member": 2},
            [("Running", "PodsRunning")],
            id="running from min member",
        ),
    ],
)
async def test_pod_phases_become_job_updates(
    harness: harnesses.Harness, job: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    await harness.offer("j1", **job)
    await harness.pump(lambda: len(harness.updates("j1")) == len(expected))
    assert harness.updates("j1") == expected
    update = harness.sent[-1]
    assert isinstance(update, messages.JobUpdate)
    assert update.epoch == 1 and update.traceparent == agentbuilders.TRACEPARENT


async def test_a_failed_gang_deletes_its_other_pods(harness: harnesses.Harness) -> None:
    await harness.offer("j1", gpus=2, replicas=2)
    await harness.pump(lambda: harness.updates("j1") == [("Running", "PodsRunning")])
    harness.backend.set_node_ready(next(p.node for p in harness.backend.pods_of("j1")), False)
    await harness.pump(lambda: len(harness.updates("j1")) == 2)
    assert harness.updates("j1")[-1] == ("Failed", "NodeLost")
    failed = harness.sent[-1]
    assert isinstance(failed, messages.JobUpdate)
    assert failed.message.startswith("pod j1-worker-") and failed.message.endswith(": NodeLost")
    await harness.handler.close()  # the clean-up
    assert all(p.phase != status.PodPhase.RUNNING for p in harness.backend.pods_of("j1"))
    assert all(n.whole_free == n.gpu_count for n in harness.backend.inventory() if n.ready)


async def test_a_pod_deleted_behind_the_agents_back_fails_the_job(
    harness: harnesses.Harness,
) -> None:
    await harness.offer("j1", gpus=1, replicas=2)
    await harness.pump(lambda: harness.updates("j1") == [("Running", "PodsRunning")])
    await harness.backend.delete_pod("default", "j1-worker-1", grace_seconds=0)
    await harness.pump(lambda: len(harness.updates("j1")) == 2)
    assert harness.updates("j1")[-1] == ("Failed", "PodDeleted")
    await harness.handler.close()
    assert harness.backend.pods_of("j1") == []


async def test_cancel_deletes_the_pods_and_says_cancelled(harness: harnesses.Harness) -> None:
    await harness.offer("j1", gpus=4, replicas=2)
    await harness.handler.handle_cancel(
        messages.Cancel(job_id="j1", epoch=1, reason="UserCancelled", grace_seconds=5)
    )
    assert harness.updates("j1") == [("Cancelled", "UserCancelled")]
    update = harness.sent[-1]
    assert isinstance(update, messages.JobUpdate)
    assert {p.phase for p in update.pods} == {status.PodPhase.DELETED}
    assert harness.backend.pods() == []
    # the DELETED events that follow are no failure
    await harness.pump(harness.backend._queue.empty)
    assert harness.updates("j1") == [("Cancelled", "UserCancelled")]


async def test_cancel_of_an_unknown_job_still_says_cancelled(harness: harnesses.Harness) -> None:
    await harness.handler.handle_cancel(messages.Cancel(job_id="nope", epoch=3, reason="Gone"))
    assert harness.updates("nope") == [("Cancelled", "Gone")]


async def test_hello_lists_held_jobs_and_finished_ones_not_acknowledged(
    harness: harnesses.Harness,
) -> None:
    await harness.offer("running", gpus=1)
    await harness.offer("done", gpus=1, duration=0.01)
    await harness.pump(lambda: harness.handler.table.get("done").state.terminal)  # type: ignore[union-attr]
    listed = {(j.job_id, j.state.value) for j in harness.handler.hello_jobs()}
    assert listed == {("running", "Running"), ("done", "Succeeded")}
    # written on the session, not acknowledged: listed however long the broker takes
    harness.now += 3600
    assert sorted(j.job_id for j in harness.handler.hello_jobs()) == ["done", "running"]
    (seq,) = harness.handler.updates.pending
    assert harness.handler.updates.acknowledge([seq]) == 1
    assert [j.job_id for j in harness.handler.hello_jobs()] == ["running"]
    # the record stays a minute for re-sent offers, then goes
    harness.now += 59
    harness.handler.hello_jobs()
    assert harness.handler.table.get("done") is not None
    harness.now += 2
    harness.handler.hello_jobs()
    assert harness.handler.table.get("done") is None
    assert harness.handler.table.get("running") is not None


async def test_offers_are_handled_one_at_a_time(harness: harnesses.Harness) -> None:
    # 20 offers of 1 GPU at once: exactly the 20 GPUs of the cluster, none booked twice
    await asyncio.gather(*(harness.offer(f"j{i}", gpus=1) for i in range(20)))
    assert all(isinstance(r, messages.Accepted) for r in harness.replies)
    slots = [(p.node, g.index) for r in harness.replies for p in r.pods for g in p.gpus]  # type: ignore[union-attr]
    assert len(set(slots)) == 20
    assert isinstance(await harness.offer("j20", gpus=1), messages.Rejected)
