"""GPU health on the Kubernetes backend, against kmock's emulator over real HTTP with the
objects as the API server stores them: a GPU the device plugin drops from allocatable, a
health taint, a DRA device taint or the kubelet's `allocatedResourcesStatus` takes the GPU out
of the inventory within one watch event; a gang with a pod on it fails `GPUFailed` as a unit
and its retry goes elsewhere; with auto-cordon, the node is cordoned."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from broker.api import messages
from member_agent.cluster import errors, gpuhealth
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.inventory import summary
from tests import kubeemulator
from tests.conftest_kube import Kube, KubeAgent, Start, following, gpu_job
from tests.kubeemulator import GPU, H100, until

XID = "nvidia.com/gpu-xid"


def updates(agent: KubeAgent, job_id: str) -> list[tuple[str, str]]:
    return [
        (m.state.value, m.reason)
        for m in agent.sent
        if isinstance(m, messages.JobUpdate) and m.job_id == job_id
    ]


def gpu_totals(backend: k8s.KubernetesBackend) -> tuple[int, int, int]:
    found = summary.summarise(backend.inventory()).model(H100)
    assert found is not None
    return found.total_gpus, found.free_gpus, found.unavailable_gpus


async def offer(agent: KubeAgent, job_id: str, *, attempt: int, **job: Any) -> messages.Message:
    replies: list[messages.Message] = []
    sent = messages.Offer(
        job_id=job_id, epoch=1, tenant="team", job=gpu_job(**job), attempt=attempt
    )
    await agent.handler.handle_offer(sent, session_epoch=1, reply=replies.append)
    return replies[-1]


async def test_a_gpu_dropped_from_allocatable_leaves_the_inventory(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=4)
        assert isinstance(reply, messages.Accepted)
        held = {slot.index for slot in reply.pods[0].gpus}
        assert gpu_totals(backend) == (8, 4, 0)
        # the device plugin marks one GPU unhealthy: allocatable 7 of capacity 8
        await emulator.patch_node("n1", {"status": {"allocatable": {GPU: "7"}}})
        await until(lambda: gpu_totals(backend) == (8, 3, 1))
        node = backend.inventory().nodes["n1"]
        assert len(node.unhealthy) == 1 and not node.unhealthy & held  # a free one, not ours
        assert node.available and updates(agent, "j1") == []
        # five gone: four free GPUs are not enough, so gpufed's pod is on one of them
        await emulator.patch_node("n1", {"status": {"allocatable": {GPU: "3"}}})
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        assert gpu_totals(backend)[2] == 5
        # the device plugin offers them all again: healthy, all free once the pod is gone
        await emulator.patch_node("n1", {"status": {"allocatable": {GPU: "8"}}})
        await until(lambda: gpu_totals(backend) == (8, 8, 0))
        assert emulator.pod("default", reply.pods[0].name) is None  # deleted with its gang
    book = backend.gpu_health()
    assert (book.gpu_failures, book.failed_pods, book.cordons) == (5, 1, 0)  # 1, then 4 more


async def test_a_health_taint_takes_out_the_gpus_it_names_not_the_node(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    taint = {"key": XID, "value": "gpu-2.gpu-5", "effect": "NoSchedule"}
    await emulator.patch_node("n1", {"spec": {"taints": [taint]}})
    await until(lambda: backend.inventory().nodes["n1"].unhealthy == {2, 5})
    node = backend.inventory().nodes["n1"]
    assert node.available and node.gpu_free == [1000, 1000, 0, 1000, 1000, 0, 1000, 1000]
    kubernetes_validate.validate(emulator.node("n1"), "1.34", strict=True)
    with pytest.raises(errors.PermanentBackendError, match="GPU 2 of node n1 is unhealthy"):
        await backend.create_pod(kubeemulator.pod_request("late", "n1", [1, 2]))
    # an XID code names no GPU: the whole node's GPUs are out
    await emulator.patch_node("n1", {"spec": {"taints": [{**taint, "value": "79"}]}})
    await until(lambda: gpu_totals(backend) == (8, 0, 8))
    await emulator.patch_node("n1", {"spec": {"taints": []}})
    await until(lambda: gpu_totals(backend) == (8, 8, 0))


async def test_a_gpu_failing_under_a_running_gang_fails_it_and_the_retry_goes_elsewhere(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    for name in ("n1", "n2"):
        await emulator.add_node(name, gpus=8)
    settings = gpuhealth.HealthSettings(auto_cordon=True, cordon_after=1)
    backend = await start(health_settings=settings)
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=4, replicas=2)
        assert isinstance(reply, messages.Accepted)
        for pod in reply.pods:
            await emulator.set_pod_phase("default", pod.name, "Running")
        await until(lambda: ("Running", "PodsRunning") in updates(agent, "j1"))
        victim = reply.pods[0]
        index = victim.gpus[0].index
        # node-problem-detector (or a person) taints the node for an XID on that GPU
        taint = {"key": XID, "value": f"gpu-{index}", "effect": "NoSchedule"}
        await emulator.patch_node(victim.node, {"spec": {"taints": [taint]}})
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        [failed] = [
            m for m in agent.sent if isinstance(m, messages.JobUpdate) and m.state.value == "Failed"
        ]
        assert f"pod {victim.name} on node {victim.node}: GPUFailed" in failed.message
        # the whole gang goes: every pod of it deleted
        await until(lambda: all(emulator.pod("default", p.name) is None for p in reply.pods))
        # one failure is enough here: the node is cordoned, saying why
        await until(lambda: emulator.node(victim.node)["spec"].get("unschedulable") is True)
        cordoned = emulator.node(victim.node)
        assert cordoned["metadata"]["annotations"][gpuhealth.CORDON_ANNOTATION] == (
            "GPUFailed: 1 GPU failures on this node within 1h"
        )
        kubernetes_validate.validate(cordoned, "1.34", strict=True)
        await until(lambda: not backend.inventory().nodes[victim.node].available)
        # the broker retries it (GPUFailed is in retryOn): attempt 2 lands on the other node
        retry = await offer(agent, "j1", attempt=2, gpus=4, replicas=2)
        assert isinstance(retry, messages.Accepted)
        assert {p.node for p in retry.pods} == {"n1", "n2"} - {victim.node}
    book = backend.gpu_health()
    assert (book.failed_pods, book.cordons, book.unhealthy_gpus()) == (1, 1, {victim.node: 1})


async def test_the_kubelet_reporting_a_pods_gpu_unhealthy_fails_it(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=2)
        assert isinstance(reply, messages.Accepted)
        name = reply.pods[0].name
        await emulator.set_pod_phase("default", name, "Running")
        await until(lambda: ("Running", "PodsRunning") in updates(agent, "j1"))
        health = [{"resourceID": "GPU-9f1c", "health": "Unhealthy"}]
        container = {
            "name": "main",
            "image": "trainer:1",
            "imageID": "",
            "ready": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
            "allocatedResourcesStatus": [{"name": GPU, "resources": health}],
        }
        pod = emulator.pod("default", name)
        assert pod is not None
        reported = {**pod, "status": {**pod["status"], "containerStatuses": [container]}}
        kubernetes_validate.validate(reported, "1.34", strict=True)  # the kubelet's shape
        path = f"/api/v1/namespaces/default/pods/{name}"
        await emulator._send("PATCH", path, {"status": {"containerStatuses": [container]}})
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        await until(lambda: emulator.pod("default", name) is None)  # deleted
        await until(lambda: backend.inventory().nodes["n1"].whole_free == 8)  # its GPUs back
    assert backend.gpu_health().failed_pods == 1


@pytest.fixture
def dra_kube(kube: Kube) -> Kube:
    kube[0].declare_dra(("v1",))
    return kube


async def test_a_dra_device_tainted_under_a_gang_fails_it(dra_kube: Kube, start: Start) -> None:
    emulator, _ = dra_kube
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    backend = await start(devices="dra")
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=2)
        assert isinstance(reply, messages.Accepted)
        index = reply.pods[0].gpus[0].index
        await emulator.set_pod_phase("default", reply.pods[0].name, "Running")
        await until(lambda: ("Running", "PodsRunning") in updates(agent, "j1"))
        # the driver republishes the pool with the device tainted (its XID health check)
        body = await emulator.add_slice(
            "n1", generation=2, name="n1-gpu.nvidia.com-g2", tainted=(index,)
        )
        kubernetes_validate.validate(body, "1.34", strict=True)
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        node = backend.inventory().nodes["n1"]
        assert node.unhealthy == {index} and node.gpu_free[index] == 0
        assert gpu_totals(backend)[2] == 1


async def test_a_claim_saying_its_device_is_unhealthy_fails_the_pod_on_it(
    dra_kube: Kube, start: Start
) -> None:
    emulator, _ = dra_kube
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    backend = await start(devices="dra")
    agent = KubeAgent(backend)
    async with following(backend, agent.handler):
        reply = await offer(agent, "j1", attempt=1, gpus=2)
        assert isinstance(reply, messages.Accepted)
        pod = reply.pods[0]
        await emulator.set_pod_phase("default", pod.name, "Running")
        await until(lambda: ("Running", "PodsRunning") in updates(agent, "j1"))
        # the DRA driver reports on the pod's claim that one of its devices is unhealthy
        index = pod.gpus[1].index
        condition = {
            "type": "GPUUnhealthy",
            "status": "True",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "reason": "XID",
            "message": "Xid 79: GPU has fallen off the bus",
        }
        device = {"driver": "gpu.nvidia.com", "pool": "n1", "device": f"gpu-{index}"}
        status = {"devices": [{**device, "conditions": [condition]}]}
        claim = emulator.claim("default", f"{pod.name}-gpus")
        assert claim is not None
        kubernetes_validate.validate(
            {**claim, "status": {**claim["status"], **status}}, "1.34", strict=True
        )
        path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{pod.name}-gpus"
        await emulator._send("PATCH", f"{path}/status", {"status": status})
        await until(lambda: ("Failed", gpuhealth.GPU_FAILED) in updates(agent, "j1"))
        assert backend.inventory().nodes["n1"].unhealthy == {index}
        # the claim goes with its pod; the GPU is healthy again once no claim says otherwise
        await until(lambda: emulator.pod("default", pod.name) is None)
        await until(lambda: not backend.inventory().nodes["n1"].unhealthy)
