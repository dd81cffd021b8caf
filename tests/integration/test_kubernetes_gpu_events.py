"""GPU health reported on the Node and across restarts, on kmock's emulator over real HTTP: with
auto-cordon the agent records a Warning Event on the Node for the cordon and for each pod of
its failed GPUFailed (valid against Kubernetes 1.34's schema and what its API server checks); an
Event it cannot write stops nothing; a restarted agent fails the pods on GPUs already unhealthy
but does not count those GPUs toward cordoning again."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]

from broker.api import messages
from member_agent.cluster import gpuhealth
from member_agent.cluster.kubernetes import events
from tests.conftest_kube import Kube, KubeAgent, Start, following
from tests.integration.test_kubernetes_gpu_health import XID, offer, updates
from tests.kubeemulator import until
from tests.kubeevents import api_server_problems

CORDON_ON_FIRST = gpuhealth.HealthSettings(auto_cordon=True, cordon_after=1)


def taint(*indices: int) -> dict[str, Any]:
    value = ".".join(f"gpu-{i}" for i in indices)
    return {"spec": {"taints": [{"key": XID, "value": value, "effect": "NoSchedule"}]}}


def by_reason(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {event["reason"]: event for event in found}


async def test_a_cordon_and_the_gang_it_failed_are_events_on_the_node(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start(health_settings=CORDON_ON_FIRST)
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=2)
        assert isinstance(reply, messages.Accepted)
        pod = reply.pods[0]
        await emulator.set_pod_phase("default", pod.name, "Running")
        await emulator.patch_node("n1", taint(pod.gpus[0].index))
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        await until(lambda: backend.gpu_health().events_written == 2)
    node = emulator.node("n1")
    written = by_reason(emulator.events())
    assert sorted(written) == sorted([events.CORDONED, gpuhealth.GPU_FAILED])
    for event in written.values():
        kubernetes_validate.validate(event, "1.34", strict=True)
        assert api_server_problems(event) == []
        # what `kubectl describe node n1` looks up: the Node by kind, name and uid
        assert event["regarding"] == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": "n1",
            "uid": node["metadata"]["uid"],
        }
        assert event["metadata"]["namespace"] == "default"
        assert (event["type"], event["reportingController"]) == (
            "Warning",
            "gpufed.io/member-agent",
        )
    index = pod.gpus[0].index
    cordon = written[events.CORDONED]
    assert cordon["action"] == "Cordon"
    assert cordon["note"] == (
        "cordoned by gpufed: GPUFailed: 1 GPU failures on this node within 1h; unhealthy GPUs "
        f"{index} (taint {XID}=gpu-{index}); uncordon it after the repair"
    )
    failed = written[gpuhealth.GPU_FAILED]
    assert failed["action"] == "FailGang"
    assert failed["note"].startswith(f"pod {pod.name} of job j1 failed GPUFailed; unhealthy GPUs")
    assert failed["related"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "default",
        "name": pod.name,
    }
    book = backend.gpu_health()
    assert (book.events_written, book.events_failed) == (2, 0)


async def test_without_auto_cordon_no_event_is_written(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=2)
        assert isinstance(reply, messages.Accepted)
        await emulator.patch_node("n1", taint(reply.pods[0].gpus[0].index))
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        await until(lambda: emulator.pod("default", reply.pods[0].name) is None)
        await asyncio.sleep(0.2)  # what would have been written in the background by now
    assert emulator.requests_of("create", "events") == [] and emulator.events() == []


async def test_an_event_that_cannot_be_written_stops_neither_the_cordon_nor_the_agent(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    for name in ("n1", "n2"):
        await emulator.add_node(name, gpus=8)
    emulator.fail("create", "events", times=2, status=403)  # no RBAC for events
    backend = await start(health_settings=CORDON_ON_FIRST)
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=8)
        assert isinstance(reply, messages.Accepted)
        victim = reply.pods[0].node
        await emulator.patch_node(victim, taint(0))
        await until(lambda: emulator.node(victim)["spec"].get("unschedulable") is True)
        await until(lambda: backend.gpu_health().events_failed == 2)
        assert emulator.events() == []
        # the agent goes on: the retry is placed, on the other node
        retry = await offer(agent, "j1", attempt=2, gpus=8)
        assert isinstance(retry, messages.Accepted)
        assert retry.pods[0].node != victim
    assert backend.gpu_health().events_written == 0


async def test_a_restarted_agent_fails_the_pods_on_gpus_already_unhealthy_but_counts_none(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    first = await start()
    reply = await offer(KubeAgent(first), "j1", attempt=1, gpus=2, replicas=2)
    assert isinstance(reply, messages.Accepted)
    for pod in reply.pods:
        await emulator.set_pod_phase("default", pod.name, "Running")
    await first.close()
    # the agent is away; meanwhile a GPU of the first pod fails, one of no pod's too
    held = {slot.index for pod in reply.pods for slot in pod.gpus}
    free = min(set(range(8)) - held)
    await emulator.patch_node("n1", taint(reply.pods[0].gpus[0].index, free))

    backend = await start(health_settings=CORDON_ON_FIRST)  # it would cordon on one failure
    after = KubeAgent(backend)
    assert after.handler.adopt(backend.held_jobs()) == 1
    async with following(backend, after.handler):
        # the gang on the broken GPU fails as it would have with the agent up
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(after, "j1"))
        await until(lambda: all(emulator.pod("default", p.name) is None for p in reply.pods))
        book = backend.gpu_health()
        assert (book.gpu_failures, book.seeded_gpus, book.failed_pods) == (0, 2, 1)
        assert book.unhealthy_gpus() == {"n1": 2}  # out of service all the same
        assert not emulator.node("n1")["spec"].get("unschedulable") and book.cordoned == {}
        # a GPU failing once the agent runs is a failure: with cordon_after 1, the node goes
        index = min(set(range(8)) - {reply.pods[0].gpus[0].index, free})
        await emulator.patch_node("n1", taint(reply.pods[0].gpus[0].index, free, index))
        await until(lambda: emulator.node("n1")["spec"].get("unschedulable") is True)
    assert (book.gpu_failures, book.cordons) == (1, 1)


async def test_a_restarted_agent_in_dra_mode_fails_the_pod_on_a_device_tainted_meanwhile(
    dra: Kube, start: Start
) -> None:
    emulator, _ = dra
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    first = await start(devices="dra")
    reply = await offer(KubeAgent(first), "j1", attempt=1, gpus=2)
    assert isinstance(reply, messages.Accepted)
    await emulator.set_pod_phase("default", reply.pods[0].name, "Running")
    await first.close()
    index = reply.pods[0].gpus[0].index
    # the slices are read before the nodes and pods: the pod is listed after its GPU's taint
    await emulator.add_slice("n1", generation=2, name="n1-gpu.nvidia.com-g2", tainted=(index,))
    backend = await start(devices="dra", health_settings=CORDON_ON_FIRST)
    after = KubeAgent(backend)
    assert after.handler.adopt(backend.held_jobs()) == 1
    async with following(backend, after.handler):
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(after, "j1"))
    book = backend.gpu_health()
    assert (book.failed_pods, book.gpu_failures, book.seeded_gpus, book.cordons) == (1, 0, 1, 0)
