"""GPU sharing in device-plugin mode, against kmock's emulator over real HTTP: a pod asking
part of a GPU goes only where the device plugin advertises shared replicas (time-slicing or
MPS, `nvidia.com/gpu.shared` unless configured) and requests one of them, never a whole
`nvidia.com/gpu`; where no node advertises them the agent refuses the job and says why."""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import messages
from member_agent.cluster.kubernetes import objects
from member_agent.inventory import model
from tests.conftest_kube import Kube, KubeAgent, Start, gpu_job
from tests.kubeemulator import GPU, until

SHARED = "nvidia.com/gpu.shared"
HALF = {"gpufed.io/gpu-milli": "500"}


def shared_node(replicas: int = 4, gpus: int = 8, resource: str = SHARED) -> dict[str, Any]:
    """A node whose GPUs the device plugin time-slices `replicas` ways, renamed to `resource`
    (`renameByDefault`), as the node's allocatable and GFD's labels then say."""
    return {
        "gpus": 0,
        "allocatable": {resource: str(gpus * replicas)},
        "labels": {"nvidia.com/gpu.replicas": str(replicas), "nvidia.com/gpu.count": str(gpus)},
    }


def limits_of(pod: dict[str, Any] | None) -> dict[str, Any]:
    assert pod is not None
    return dict(pod["spec"]["containers"][0]["resources"]["limits"])


@pytest.mark.parametrize(
    ("start_args", "node", "job", "reason"),
    [
        pytest.param(
            {},
            {"gpus": 8},
            {"annotations": HALF},
            "gpu sharing: no ready GPU node advertises nvidia.com/gpu.shared (the device "
            "plugin's shared GPU replicas): a pod of 500 milli of 1 GPU would be handed a "
            "whole GPU",
            id="gpu-milli where no node advertises nvidia.com/gpu.shared",
        ),
        pytest.param(
            {"shared_gpu_resource": "example.com/gpu-slice"},
            {"gpus": 8, "allocatable": {SHARED: "32"}},  # not the resource this agent was given
            {"annotations": HALF},
            "gpu sharing: no ready GPU node advertises example.com/gpu-slice (the device "
            "plugin's shared GPU replicas): a pod of 500 milli of 1 GPU would be handed a "
            "whole GPU",
            id="the shared resource's name is configurable",
        ),
        pytest.param(
            {},
            shared_node(),
            {"gpus": 2},
            "gpu sharing: the ready GPU nodes offer their GPUs only as nvidia.com/gpu.shared "
            "replicas, none whole for a pod of 2 GPUs",
            id="whole GPUs where every GPU is a shared replica",
        ),
    ],
)
async def test_an_offer_the_device_plugin_cannot_honour_is_refused_with_the_reason(
    kube: Kube,
    start: Start,
    *,
    start_args: dict[str, Any],
    node: dict[str, Any],
    job: dict[str, Any],
    reason: str,
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", **node)
    agent = KubeAgent(await start(**start_args))
    reply = await agent.offer("j1", gpu_job(**job))
    assert isinstance(reply, messages.Rejected)
    assert reply.reasons == [reason]
    assert agent.handler.offers == {"unplaceable": 1}
    assert emulator.requests_of("create", "pods") == []


async def test_sharing_pods_request_a_shared_replica_and_whole_pods_whole_gpus(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("shared", **shared_node())
    await emulator.add_node("whole", gpus=8)
    backend = await start()
    node = backend.inventory().nodes["shared"]
    assert (node.gpu_count, node.labels[model.SHARING_LABEL]) == (8, model.SHARING_REPLICAS)
    assert backend.inventory().nodes["whole"].labels[model.SHARING_LABEL] == model.SHARING_NONE
    agent = KubeAgent(backend)
    sharing = await agent.offer("j1", gpu_job("serve", replicas=2, annotations=HALF))
    whole = await agent.offer("j2", gpu_job("train", gpus=4))
    assert isinstance(sharing, messages.Accepted) and isinstance(whole, messages.Accepted)
    assert {p.node for p in sharing.pods} == {"shared"}
    assert {p.node for p in whole.pods} == {"whole"}
    for pod in sharing.pods:
        assert limits_of(emulator.pod("default", pod.name)) == {SHARED: 1}
    assert limits_of(emulator.pod("default", "j2-worker-0")) == {GPU: 4}
    # what the pods hold, read back from the watch, is what was counted: half a GPU each
    await until(lambda: backend.watches[1].resource_version == str(emulator.version))
    held = sorted(m for m in backend.inventory().nodes["shared"].gpu_free if m < 1000)
    assert sum(1000 - m for m in held) == 1000
    assert backend.gpu_quotas("default") == []  # and a quota on nvidia.com/gpu: none counted


async def test_no_more_sharing_pods_than_the_device_plugin_has_replicas(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", **shared_node(replicas=2, gpus=1))
    agent = KubeAgent(await start())
    small = {"gpufed.io/gpu-milli": "300"}  # three fit in 1000 milli, the kubelet has two
    replies = [await agent.offer(f"j{i}", gpu_job(f"s{i}", annotations=small)) for i in range(3)]
    assert [type(r).__name__ for r in replies] == ["Accepted", "Accepted", "Rejected"]
    rejected = replies[2]
    assert isinstance(rejected, messages.Rejected)
    assert "node n1: all 2 nvidia.com/gpu.shared replicas are in use" in rejected.reasons[0]
    assert len(emulator.requests_of("create", "pods")) == 2


async def test_replicas_advertised_as_nvidia_com_gpu_are_not_whole_gpus(
    kube: Kube, start: Start
) -> None:
    """Time-slicing without renaming: `nvidia.com/gpu` counts replicas, 32 of 8 GPUs. A pod
    asking one would get a replica, not a GPU: whole-GPU pods stay away, sharing pods ask one."""
    emulator, _ = kube
    await emulator.add_node("n1", **shared_node(resource=GPU))
    backend = await start()
    node = backend.inventory().nodes["n1"]
    assert (node.gpu_count, node.labels[model.SHARED_RESOURCE_LABEL]) == (8, GPU)
    agent = KubeAgent(backend)
    whole = await agent.offer("j1", gpu_job(gpus=1))
    assert isinstance(whole, messages.Rejected) and "only as nvidia.com/gpu" in whole.reasons[0]
    sharing = await agent.offer("j2", gpu_job(annotations=HALF))
    assert isinstance(sharing, messages.Accepted)
    assert limits_of(emulator.pod("default", "j2-worker-0")) == {GPU: 1}


async def test_a_foreign_pod_holding_a_shared_replica_holds_a_replicas_share(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", **shared_node(replicas=4, gpus=2))
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "notebook", "namespace": "other-team"},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "main", "image": "x", "resources": {"limits": {SHARED: "3"}}}],
        },
        "status": {"phase": "Running"},
    }
    await emulator._send("POST", "/api/v1/namespaces/other-team/pods", body)
    backend = await start()
    assert sorted(backend.inventory().nodes["n1"].gpu_free) == [500, 750]  # 3 replicas of 250
    rec = objects.read_pod(body)
    assert (rec.gpus, rec.shared, rec.quota_gpus) == (3, True, 0)


async def test_the_configured_shared_resource_is_the_one_requested(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", **shared_node(resource="example.com/gpu-slice"))
    agent = KubeAgent(await start(shared_gpu_resource="example.com/gpu-slice"))
    reply = await agent.offer("j1", gpu_job(annotations=HALF))
    assert isinstance(reply, messages.Accepted)
    assert limits_of(emulator.pod("default", "j1-worker-0")) == {"example.com/gpu-slice": 1}
