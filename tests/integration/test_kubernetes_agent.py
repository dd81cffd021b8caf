"""The agent's job handler on the Kubernetes backend, against kmock's emulator over real HTTP:
ResourceQuotas on GPUs refuse an offer before anything is created, a finished job's pods are
deleted once their TTL after the broker's acknowledgement has passed, and a restarted agent
finds its jobs in the pods it created."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from broker.api import messages, status
from member_agent.cluster import base
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.jobs import handling
from member_agent.placement import limits
from tests import agentbuilders, kubeemulator
from tests.conftest_kube import Kube, Start
from tests.kubeemulator import GPU, H100, until

REQ = f"requests.{GPU}"


def quotas_of(backend: k8s.KubernetesBackend, namespace: str) -> list[tuple[str, int, int]]:
    return [(q.name, q.hard, q.used) for q in backend.gpu_quotas(namespace)]


class Agent:
    """A job handler on a backend, replies and updates recorded."""

    def __init__(
        self, backend: k8s.KubernetesBackend, agent_limits: limits.AgentLimits | None = None
    ) -> None:
        self.sent: list[messages.Message] = []
        self.now = 1000.0
        self.handler = handling.JobHandler(
            backend,
            send=self._send,
            agent_limits=agent_limits,
            failure_grace_seconds=0,
            clock=lambda: self.now,
        )

    def _send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        self.sent.append(message)

    async def offer(self, job_id: str, *, epoch: int = 1, **job: Any) -> messages.Message:
        replies: list[messages.Message] = []
        offer = agentbuilders.make_offer(job_id, agentbuilders.make_job(**job), epoch=epoch)
        await self.handler.handle_offer(offer, session_epoch=epoch, reply=replies.append)
        return replies[-1]


# -- ResourceQuotas ------------------------------------------------------------------------


async def test_quotas_are_listed_then_watched(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.set_quota("team-a", "gpus", {REQ: "16"}, used={REQ: "2"})
    await emulator.set_quota("team-b", "gpus", {REQ: "4"})
    backend = await start(namespaces=["team-a"])
    assert quotas_of(backend, "team-a") == [("gpus", 16, 2)]
    assert quotas_of(backend, "team-b") == []  # not a namespace this agent may use
    listed = emulator.requests_of("list", "resourcequotas")
    assert [r.namespace for r in listed] == ["team-a"]

    await emulator.set_quota("team-a", "gpus", {REQ: "8"}, used={REQ: "6"})
    await emulator.set_quota("team-a", "more", {f"limits.{GPU}": "12"})
    await until(lambda: quotas_of(backend, "team-a") == [("gpus", 8, 6), ("more", 12, 0)])
    await emulator.delete_quota("team-a", "gpus")
    await until(lambda: quotas_of(backend, "team-a") == [("more", 12, 0)])


async def test_quota_use_counts_the_pods_before_the_quota_status_does(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.set_quota("team-a", "gpus", {REQ: "8"})  # status.used stays 0 on kmock
    await emulator.add_pod("team-a", "notebook", node="n1", gpus=1)
    await emulator.add_pod("team-a", "done", node="n1", gpus=4, phase="Succeeded")
    backend = await start()
    assert quotas_of(backend, "team-a") == [("gpus", 8, 1)]  # a finished pod counts no more
    await backend.create_pod(kubeemulator.pod_request("job-a-worker-0", "n1", [0, 1, 2]))
    assert quotas_of(backend, "team-a") == [("gpus", 8, 4)]  # before any watch reports it
    await emulator.set_pod_phase("team-a", "job-a-worker-0", "Succeeded")
    await until(lambda: quotas_of(backend, "team-a") == [("gpus", 8, 1)])


@pytest.mark.parametrize(
    ("quota", "file_limit", "reason"),
    [
        pytest.param(
            ({REQ: "12"}, {REQ: "6"}),
            None,
            "namespace team-a: ResourceQuota gpus allows 12 requests.nvidia.com/gpu, 6 used, "
            "6 left, the job asks for 8",
            id="over the ResourceQuota",
        ),
        pytest.param(
            ({REQ: "64"}, {}),
            4,
            "namespace team-a: GPU limit 4 on this cluster, 0 in use, the job asks for 8",
            id="the limits file is stricter",
        ),
        pytest.param(
            ({REQ: "4"}, {}),
            32,
            "namespace team-a: ResourceQuota gpus allows 4 requests.nvidia.com/gpu, 0 used, "
            "4 left, the job asks for 8",
            id="the quota is stricter",
        ),
    ],
)
async def test_an_offer_over_a_gpu_quota_is_rejected_having_created_nothing(
    kube: Kube,
    start: Start,
    *,
    quota: tuple[dict[str, str], dict[str, str]],
    file_limit: int | None,
    reason: str,
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.set_quota("team-a", "gpus", quota[0], used=quota[1])
    file = limits.AgentLimits(namespace_gpus={"team-a": file_limit} if file_limit else {})
    agent = Agent(await start(namespaces=["team-a"]), file)
    reply = await agent.offer("j1", gpus=4, replicas=2, namespace="team-a")
    assert isinstance(reply, messages.Rejected)
    assert reply.reasons == [reason]
    assert agent.handler.offers == {"limit": 1}
    assert emulator.requests_of("create", "pods") == []


async def test_an_offer_within_the_quota_runs_and_then_counts_against_it(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.add_node("n2", gpus=8)
    await emulator.set_quota("team-a", "gpus", {REQ: "12"})
    agent = Agent(await start(namespaces=["team-a"]))
    assert isinstance(await agent.offer("j1", gpus=8, namespace="team-a"), messages.Accepted)
    second = await agent.offer("j2", gpus=8, namespace="team-a")
    assert isinstance(second, messages.Rejected)
    assert "8 used, 4 left" in second.reasons[0]
    assert len(emulator.requests_of("create", "pods")) == 1


# -- finished pods -------------------------------------------------------------------------


async def test_a_finished_jobs_pod_is_deleted_once_its_ttl_has_passed(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    agent = Agent(backend)
    handler = agent.handler
    handler.finished_pods_ttl = 120.0
    assert isinstance(await agent.offer("j1", gpus=1), messages.Accepted)
    events = backend.events()
    await emulator.set_pod_phase("default", "j1-worker-0", "Succeeded")
    async with asyncio.timeout(10):
        while not (record := handler.table.get("j1")) or not record.state.terminal:
            handler.handle_event(await anext(events))
    [final] = [m for m in agent.sent if isinstance(m, messages.JobUpdate) and m.state.terminal]
    assert final.seq is not None
    handler.updates.acknowledge([final.seq])
    acked = agent.now
    agent.now = acked + 119  # forgotten by the table (keep_reported), the pod kept for its logs
    handler.housekeep()
    await handler.deleter.close()
    assert handler.table.get("j1") is None
    assert emulator.pod("default", "j1-worker-0") is not None
    assert emulator.requests_of("delete", "pods") == []
    agent.now = acked + 121
    handler.housekeep()
    await handler.deleter.close()
    assert emulator.pod("default", "j1-worker-0") is None
    assert len(emulator.requests_of("delete", "pods")) == 1


# -- a restarted agent ---------------------------------------------------------------------


async def test_a_new_backend_finds_the_jobs_in_the_pods_it_created(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    for name in ("n1", "n2", "n3"):
        await emulator.add_node(name, gpus=8, product=H100)
    before = Agent(await start())
    reply = await before.offer("j1", epoch=7, gpus=8, replicas=3, min_member=2, model=H100)
    assert isinstance(reply, messages.Accepted)
    await emulator.set_pod_phase("default", "j1-worker-0", "Running")
    await emulator.set_pod_phase("default", "j1-worker-1", "Running")
    # an agent of an older version, without gpufed's annotations
    await emulator.add_pod(
        "default",
        "old-worker-0",
        node="n3",
        gpus=0,
        labels={"gpufed.io/job": "old", "gpufed.io/task": "worker"},
    )

    creates = len(emulator.requests_of("create", "pods"))
    backend = await start()  # the agent restarted: a new process, a new backend
    held = backend.held_jobs()
    assert sorted(held) == ["j1", "old"]
    job = held["j1"]
    assert (job.namespace, job.epoch, job.min_member, job.gang_size, job.gpus) == (
        "default",
        7,
        2,
        3,
        24,
    )
    assert job.traceparent == agentbuilders.TRACEPARENT
    assert [(p.name, p.phase) for p in job.pods] == [
        ("j1-worker-0", status.PodPhase.RUNNING),
        ("j1-worker-1", status.PodPhase.RUNNING),
        ("j1-worker-2", status.PodPhase.PENDING),
    ]
    assert sorted(len(p.gpus) for p in job.pods) == [8, 8, 8]
    assert held["old"] == base.HeldJob("old", "default", 0, 1, 0, 0, held["old"].pods)

    after = Agent(backend)
    assert after.handler.adopt(held) == 2
    jobs = after.handler.hello_jobs()
    assert sorted((j.job_id, j.epoch, j.state.value) for j in jobs) == [
        ("j1", 7, "Running"),
        ("old", 0, "Running"),
    ]
    # a job offered again after the restart is the same job, not a second copy
    again = await after.offer("j1", epoch=8, gpus=8, replicas=3, min_member=2, model=H100)
    assert isinstance(again, messages.Accepted)
    assert sorted(p.node for p in again.pods) == sorted(p.node for p in reply.pods)
    assert len(emulator.requests_of("create", "pods")) == creates
