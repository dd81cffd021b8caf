"""A preempted job on the agent (a handler on a simulated cluster): its pods get the notice
(`gpufed.io/preemption-notice`, the deadline) before they are deleted with the grace, keep
their GPUs while the workload runs on through it, and the job is reported Cancelled only once
they are gone; a pod's `gpufed.io/last-checkpoint` is reported to a broker that reads it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from broker.api import messages
from member_agent.cluster import base
from member_agent.cluster.simulated import backend as simulated
from tests.unit.member_agent import harnesses


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[harnesses.Harness]:
    h = harnesses.Harness(tmp_path)
    yield h
    await h.close()


def finals(h: harnesses.Harness, job_id: str) -> list[tuple[str, str]]:
    return [s for s in h.updates(job_id) if s[0] == "Cancelled"]


def free_gpus(h: harnesses.Harness) -> int:
    return sum(node.whole_free for node in h.backend.inventory())


async def running(h: harnesses.Harness, *, exit_after: float) -> None:
    annotations = {simulated.SIM_EXIT_AFTER_ANNOTATION: str(exit_after)}
    reply = await h.offer("j1", gpus=8, replicas=2, duration=300, annotations=annotations)
    assert isinstance(reply, messages.Accepted)
    await h.pump(lambda: ("Running", "PodsRunning") in h.updates("j1"))


async def preempt(h: harnesses.Harness, *, grace: float) -> float:
    before = time.time()
    cancel = messages.Cancel(job_id="j1", epoch=1, reason="Preempted", grace_seconds=grace)
    await h.handler.handle_cancel(cancel)
    return before


@pytest.mark.looptime  # the grace passes on the loop's fake time
async def test_the_pods_get_the_notice_and_keep_their_gpus_through_the_grace(
    harness: harnesses.Harness,
) -> None:
    await running(harness, exit_after=60)  # a workload that would take a minute to exit
    idle = free_gpus(harness)
    sent = await preempt(harness, grace=0.3)
    pods = harness.backend.pods()
    assert len(pods) == 2
    for pod in pods:  # told before the deletion: when they will be killed
        notice = base.read_time(pod.annotations[base.PREEMPTION_NOTICE_ANNOTATION])
        assert notice is not None
        assert abs(notice.timestamp() - (sent + 0.3)) < 0.25
        assert pod.terminating_until is not None
    assert free_gpus(harness) == idle  # still held: the workload runs on
    assert finals(harness, "j1") == []  # not reported yet: the broker counts nothing free
    loop = asyncio.get_running_loop()
    started = loop.time()
    await harness.pump(lambda: finals(harness, "j1") != [])
    assert loop.time() - started >= 0.2  # the grace, not at once
    assert finals(harness, "j1") == [("Cancelled", "Preempted")]
    assert harness.backend.pods() == []
    assert free_gpus(harness) == idle + 16


async def test_a_workload_that_exits_sooner_frees_its_gpus_sooner(
    harness: harnesses.Harness,
) -> None:
    await running(harness, exit_after=0.05)  # it checkpoints and exits on SIGTERM
    started = time.monotonic()
    await preempt(harness, grace=30)
    await harness.pump(lambda: finals(harness, "j1") != [])
    assert time.monotonic() - started < 5
    assert harness.backend.pods() == []


async def test_a_cancel_that_is_not_a_preemption_is_reported_at_once(
    harness: harnesses.Harness,
) -> None:
    await running(harness, exit_after=60)
    cancel = messages.Cancel(job_id="j1", epoch=1, reason="Cancelled", grace_seconds=0.3)
    await harness.handler.handle_cancel(cancel)
    assert finals(harness, "j1") == [("Cancelled", "Cancelled")]
    assert all(
        base.PREEMPTION_NOTICE_ANNOTATION not in p.annotations for p in harness.backend.pods()
    )


@pytest.mark.looptime
async def test_a_preemption_cancel_sent_twice_deletes_once(harness: harnesses.Harness) -> None:
    await running(harness, exit_after=60)
    await preempt(harness, grace=0.2)
    await preempt(harness, grace=0.2)
    await harness.pump(lambda: finals(harness, "j1") != [])
    assert finals(harness, "j1") == [("Cancelled", "Preempted")]


@pytest.mark.parametrize("reads", [True, False], ids=["broker reads them", "older broker"])
async def test_a_pods_checkpoint_is_reported_to_a_broker_that_reads_it(
    harness: harnesses.Harness, reads: bool
) -> None:
    harness.handler.updates.session_started(acks=True, checkpoints=reads)
    annotations = {simulated.SIM_CHECKPOINT_EVERY_ANNOTATION: "0.05"}
    await harness.offer("j1", gpus=8, duration=300, annotations=annotations)
    before = datetime.now(UTC)
    await harness.pump(lambda: harness.handler.table.get("j1").checkpoint is not None)  # type: ignore[union-attr]
    checkpoints = [
        m.checkpoint
        for m in harness.sent
        if isinstance(m, messages.JobUpdate) and m.checkpoint is not None
    ]
    if reads:
        assert len(checkpoints) == 1 and checkpoints[0] >= before.replace(microsecond=0)
    else:
        assert checkpoints == []
