"""A restarted agent adopts the jobs whose pods it finds: the state their pods imply, listed in
hello, followed afterwards, and deleted when the broker says they moved elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.api import messages, status
from member_agent.cluster import base
from member_agent.cluster.simulated import backend as simulated
from member_agent.jobs import adopting, handling, table
from tests import agentbuilders

Phase = status.PodPhase
R, P, S, F = Phase.RUNNING, Phase.PENDING, Phase.SUCCEEDED, Phase.FAILED


def held(
    phases: list[tuple[Phase, str] | Phase], *, min_member: int = 0, gang_size: int = -1
) -> base.HeldJob:
    pods = []
    for i, entry in enumerate(phases):
        phase, reason = entry if isinstance(entry, tuple) else (entry, "")
        pods.append(
            status.PodStatus(
                name=f"j1-worker-{i}",
                task="worker",
                node=f"n{i}",
                gpus=[status.GPUSlot(index=0)],
                phase=phase,
                reason=reason,
            )
        )
    return base.HeldJob(
        job_id="j1",
        namespace="team-a",
        epoch=41,
        min_member=min_member or len(pods),
        gang_size=len(pods) if gang_size < 0 else gang_size,
        gpus=len(pods),
        pods=tuple(pods),
        traceparent=agentbuilders.TRACEPARENT,
    )


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        pytest.param(held([R, R]), ("Running", "PodsRunning"), id="every pod runs"),
        pytest.param(
            held([R, P, R], min_member=2), ("Running", "PodsRunning"), id="minMember pods run"
        ),
        pytest.param(held([R, P]), ("Dispatched", ""), id="too few run yet"),
        pytest.param(held([S, S]), ("Succeeded", "AllPodsSucceeded"), id="all succeeded"),
        pytest.param(held([R, (F, "OOMKilled")]), ("Failed", "OOMKilled"), id="one failed"),
        pytest.param(held([R], gang_size=2), ("Failed", "PodDeleted"), id="a pod went away"),
        pytest.param(
            held([S], gang_size=2), ("Succeeded", "AllPodsSucceeded"), id="finished pod cleaned up"
        ),
        pytest.param(
            held([R, R], gang_size=0), ("Running", "PodsRunning"), id="pods without gang-size"
        ),
    ],
)
def test_a_found_job_gets_the_state_its_pods_imply(
    job: base.HeldJob, expected: tuple[str, str]
) -> None:
    record = adopting.record_of(job, now=5.0)
    assert (record.state.value, record.reason) == expected
    assert record.terminal_at == (5.0 if record.state.terminal else None)
    assert (record.epoch, record.namespace, record.gpus) == (41, "team-a", len(job.pods))
    assert record.traceparent == agentbuilders.TRACEPARENT
    assert not record.binding
    hello = record.agent_job()
    assert [(p.name, p.phase) for p in hello.pods] == [(p.name, p.phase) for p in job.pods]
    # a final state goes up with its reason: the broker retries an infrastructure failure
    assert hello.reason == (expected[1] if record.state.terminal else None)


def test_a_job_the_table_holds_already_is_not_adopted_again() -> None:
    jobs = table.JobTable()
    first = adopting.adopt_jobs(jobs, {"j1": held([R])}, now=1.0)
    again = adopting.adopt_jobs(jobs, {"j1": held([S])}, now=2.0)
    assert [r.job_id for r in first] == ["j1"] and again == []
    assert jobs.get("j1") is first[0]
    assert jobs.gpus_in_use("team-a") == 1  # counts against the namespace's limit


def state_of(handler: handling.JobHandler, job_id: str) -> str:
    record = handler.table.get(job_id)
    return record.state.value if record is not None else "unknown"


class Restart:
    """An agent's handler that ran jobs on a simulated cluster, then a new handler (the agent
    restarted) on the same cluster."""

    def __init__(self, tmp_path: Path) -> None:
        self.backend: simulated.SimulatedBackend = agentbuilders.small_backend(tmp_path)
        self.sent: list[messages.Message] = []
        self.events = self.backend.events()
        self.before = self._handler()
        self.after: handling.JobHandler | None = None

    def _handler(self) -> handling.JobHandler:
        return handling.JobHandler(
            self.backend,
            send=self._send,
            clock=lambda: 1000.0,
            failure_grace_seconds=0,
        )

    def _send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        self.sent.append(message)

    async def offer(self, job_id: str, *, attempt: int = 1, **job: Any) -> None:
        reply: list[messages.Message] = []
        offer = agentbuilders.make_offer(
            job_id, agentbuilders.make_job(**job), epoch=3, attempt=attempt
        )
        await self.before.handle_offer(offer, session_epoch=3, reply=reply.append)
        assert isinstance(reply[0], messages.Accepted)

    async def pump(self, handler: handling.JobHandler, until: Callable[[], bool]) -> None:
        async with asyncio.timeout(5):
            while not until():
                handler.handle_event(await anext(self.events))

    def restart(self) -> handling.JobHandler:
        self.after = self._handler()
        self.sent.clear()
        self.after.adopt(self.backend.held_jobs())
        return self.after

    def updates(self, job_id: str) -> list[tuple[str, str]]:
        return [
            (m.state.value, m.reason)
            for m in self.sent
            if isinstance(m, messages.JobUpdate) and m.job_id == job_id
        ]

    async def close(self) -> None:
        for handler in (self.before, self.after):
            if handler is not None:
                await handler.close()
        await self.backend.close()


@pytest.fixture
async def restart(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = Restart(tmp_path)
    yield r
    await r.close()


async def test_hello_after_a_restart_lists_the_jobs_still_running(restart: Restart) -> None:
    await restart.offer("long", gpus=8, replicas=2, model=agentbuilders.H100)
    await restart.offer("short", gpus=1, duration=0.01)
    await restart.pump(restart.before, lambda: state_of(restart.before, "short") == "Succeeded")
    await restart.pump(restart.before, lambda: state_of(restart.before, "long") == "Running")

    after = restart.restart()
    jobs = after.hello_jobs()
    assert sorted((j.job_id, j.epoch, j.state.value, len(j.pods)) for j in jobs) == [
        ("long", 3, "Running", 2),
        ("short", 3, "Succeeded", 1),
    ]
    assert restart.sent == []  # hello carries it all
    assert restart.backend.creates == 3  # nothing created again

    # the adopted job is followed: its pods' events reach the new handler
    restart.backend.set_node_ready("h100-000", False)
    await restart.pump(after, lambda: bool(restart.updates("long")))
    assert restart.updates("long") == [("Failed", "NodeLost")]
    update = restart.sent[-1]
    assert (
        isinstance(update, messages.JobUpdate) and update.traceparent == agentbuilders.TRACEPARENT
    )


async def test_a_gang_that_failed_while_the_agent_was_away_has_its_pods_deleted(
    restart: Restart,
) -> None:
    await restart.offer("j1", gpus=1, replicas=2)
    await restart.pump(restart.before, lambda: state_of(restart.before, "j1") == "Running")
    restart.backend.set_node_ready(restart.backend.pods_of("j1")[0].node, False)
    # the agent was down: nobody handled that event
    after = restart.restart()
    assert state_of(after, "j1") == "Failed"
    await after.close()  # the clean-up of the pods still running
    assert all(p.phase != Phase.RUNNING for p in restart.backend.pods_of("j1"))


async def test_a_cancel_for_an_adopted_job_deletes_its_pods(restart: Restart) -> None:
    """The broker moved the job elsewhere while the agent was down: its hello answer is a
    cancel (reason Stale), and the stale copy goes."""
    await restart.offer("j1", gpus=4, replicas=2)
    after = restart.restart()
    await after.handle_cancel(messages.Cancel(job_id="j1", epoch=9, reason="Stale"))
    assert restart.updates("j1") == [("Cancelled", "Stale")]
    assert restart.backend.pods() == []
    assert all(n.whole_free == n.gpu_count for n in restart.backend.inventory())


def pods_named(*entries: tuple[str, Phase]) -> tuple[status.PodStatus, ...]:
    return tuple(
        status.PodStatus(
            name=name, task="worker", node="n0", gpus=[status.GPUSlot(index=i)], phase=phase
        )
        for i, (name, phase) in enumerate(entries)
    )


@pytest.mark.parametrize(
    ("pods", "annotated", "expected"),
    [
        pytest.param(
            pods_named(("j1-worker-0", R), ("j1-worker-1", R)),
            1,
            (1, "Running", ["j1-worker-0", "j1-worker-1"], []),
            id="pods of an agent from before attempts",
        ),
        pytest.param(
            pods_named(("j1-worker-0", F), ("j1-worker-0-a2", R), ("j1-worker-1-a2", R)),
            2,
            (2, "Running", ["j1-worker-0-a2", "j1-worker-1-a2"], ["j1-worker-0"]),
            id="a failed first attempt left a pod for its logs",
        ),
        pytest.param(
            pods_named(("j1-worker-0-a2", R), ("j1-worker-0-a3", P), ("j1-worker-1-a3", S)),
            2,  # the annotation of the pod the backend read first
            (3, "Dispatched", ["j1-worker-0-a3", "j1-worker-1-a3"], ["j1-worker-0-a2"]),
            id="the agent stopped before the earlier attempt was deleted",
        ),
        pytest.param(
            pods_named(("j1-worker-0", S)),
            4,
            (4, "Succeeded", ["j1-worker-0"], []),
            id="pods named otherwise: the annotation says the attempt",
        ),
    ],
)
def test_a_found_job_is_adopted_at_its_latest_attempt(
    pods: tuple[status.PodStatus, ...],
    annotated: int,
    expected: tuple[int, str, list[str], list[str]],
) -> None:
    found = base.HeldJob("j1", "team-a", 5, 2, 2, len(pods), pods, attempt=annotated)
    record = adopting.record_of(found, now=1.0)
    earlier = adopting.earlier_pods(found)
    assert (record.attempt, record.state.value, sorted(record.pods), [p.name for p in earlier]) == (
        expected
    )
    assert record.gpus == len(record.pods)  # one GPU a pod: the earlier attempts' do not count
    assert record.agent_job().attempt == expected[0]


async def test_a_restarted_agent_deletes_the_pods_of_earlier_attempts(restart: Restart) -> None:
    await restart.offer("j1", gpus=8, replicas=2, outcome="Failed:NodeLost@1")
    await restart.pump(restart.before, lambda: state_of(restart.before, "j1") == "Failed")
    await restart.before.close()
    await restart.offer("j1", gpus=8, replicas=2, attempt=2)
    await restart.pump(restart.before, lambda: state_of(restart.before, "j1") == "Running")
    assert any(p.phase == Phase.FAILED for p in restart.backend.pods_of("j1"))

    after = restart.restart()
    jobs = after.hello_jobs()
    assert [(j.job_id, j.attempt, j.state.value, sorted(p.name for p in j.pods)) for j in jobs] == [
        ("j1", 2, "Running", ["j1-worker-0-a2", "j1-worker-1-a2"])
    ]
    await after.close()  # the clean-up of the earlier attempt's pods
    assert sorted(p.name for p in restart.backend.pods_of("j1")) == [
        "j1-worker-0-a2",
        "j1-worker-1-a2",
    ]
