"""MIG on the Kubernetes backend against kmock's emulator over real HTTP, in both modes: the
device plugin's `nvidia.com/mig-<profile>` (counted, other workloads' pods included; gpufed's
pods request the profile), and DRA, where a MIG pod's ResourceClaim is allocated to exactly
the MIG devices placement chose. Pods and claims are checked against Kubernetes 1.34's OpenAPI
schemas (kubernetes-validate)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]

from broker.api import jobs, messages, mig
from member_agent.cluster.kubernetes import mig as migs
from member_agent.inventory import summary
from tests.conftest_kube import Kube, KubeAgent, Start, gpu_job
from tests.kubeemulator import GPU, H100, until

PROFILE = "1g.10gb"
RESOURCE = mig.resource_of(PROFILE)


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, "1.34", strict=True)


def mig_job(name: str, *, slices: int, replicas: int = 1, resource: bool = False) -> jobs.GPUJob:
    """`replicas` pods of `slices` MIG devices of PROFILE: asked with the annotation and
    nvidia.com/gpu, or (`resource`) as nvidia.com/mig-<profile> in the limits."""
    if not resource:
        return gpu_job(
            name, gpus=slices, replicas=replicas, annotations={mig.MIG_PROFILE_ANNOTATION: PROFILE}
        )
    doc = gpu_job(name, gpus=1, replicas=replicas).model_dump(by_alias=True, exclude_none=True)
    container = doc["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    container["resources"]["limits"] = {RESOURCE: slices}
    return jobs.validate_submitted(doc)


def free_slices(backend: Any, node: str = "n1") -> tuple[int, ...]:
    return tuple(backend.inventory().nodes[node].mig_free.get(PROFILE, ()))


async def add_foreign_mig_pod(emulator: Any, name: str, count: int) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "other-team"},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "main", "image": "busybox", "resources": {"limits": {RESOURCE: count}}}
            ],
        },
        "status": {"phase": "Running"},
    }
    await emulator._send("POST", "/api/v1/namespaces/other-team/pods", body)


# -- device-plugin mode ----------------------------------------------------------------------


async def test_device_plugin_mig_pods_request_their_profile_and_are_counted(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    allocatable = {RESOURCE: "7", "nvidia.com/mig-3g.40gb": "1"}
    await emulator.add_node("n1", gpus=0, allocatable=allocatable)
    await emulator.add_node("n2", gpus=8)  # whole GPUs only: no MIG pod goes there
    await add_foreign_mig_pod(emulator, "notebook", 2)
    backend = await start()
    node = backend.inventory().nodes["n1"]
    assert node.mig == {PROFILE: 7, "3g.40gb": 1}
    assert node.labels.get("gpufed.io/mig.1g.10gb") is None  # counts are not labels any more
    assert len(free_slices(backend)) == 5  # someone else's pod holds 2
    [h100] = summary.summarise(backend.inventory()).models
    assert h100.model == H100 and h100.mig is not None and h100.mig[PROFILE].free == 5

    agent = KubeAgent(backend)
    reply = await agent.offer("j1", mig_job("small", slices=3))
    assert isinstance(reply, messages.Accepted), reply
    [placed] = reply.pods
    assert placed.node == "n1" and placed.gpus == []
    pod = emulator.pod("default", placed.name)
    assert pod is not None
    [container] = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {RESOURCE: 3}  # not nvidia.com/gpu
    booked = migs.parse_slots(pod["metadata"]["annotations"][migs.MIG_ANNOTATION])[PROFILE]
    assert len(booked) == 3 and not set(booked) & set(free_slices(backend))
    validate(pod)
    assert len(free_slices(backend)) == 2

    # 3 more do not fit the 2 left: refused, nothing created
    refused = await agent.offer("j2", mig_job("more", slices=3))
    assert isinstance(refused, messages.Rejected)
    assert any("1g.10gb" in reason for reason in refused.reasons), refused.reasons
    assert emulator.pod("default", "j2-worker-0") is None

    # someone else's pod going away gives its devices back; a restarted agent counts the same
    await emulator.delete_pod("other-team", "notebook")
    await until(lambda: len(free_slices(backend)) == 4)
    again = await start()
    assert free_slices(again) == free_slices(backend)


# -- DRA mode ----------------------------------------------------------------------------------


async def test_dra_mig_pods_hold_exactly_the_mig_devices_placement_chose(
    dra: Kube, start: Start
) -> None:
    emulator, _ = dra
    await emulator.add_node("n1", gpus=0)
    # GPU 0 whole; GPU 1 in MIG mode, published whole too (as a driver partitioning on
    # demand does) and as four 1g.10gb devices
    published = await emulator.add_slice("n1", gpus=2, mig=4, mig_parent=1)
    validate(published)
    names = sorted(
        d["name"]
        for d in published["spec"]["devices"]
        if d["attributes"]["type"]["string"] == "mig"
    )
    uuids = {d["name"]: d["attributes"]["uuid"]["string"] for d in published["spec"]["devices"]}
    await emulator.add_allocated_claim("other-team", "notebook", "n1", [names[0]])
    backend = await start(devices="dra")
    node = backend.inventory().nodes["n1"]
    assert node.gpu_free == [1000, 0]  # the GPU whose MIG devices are published is not whole
    assert node.mig == {PROFILE: 4}
    await until(lambda: free_slices(backend) == (1, 2, 3))  # the other claim holds device 0

    agent = KubeAgent(backend)
    reply = await agent.offer("j1", mig_job("infer", slices=1, replicas=2, resource=True))
    assert isinstance(reply, messages.Accepted), reply
    chosen_all: list[str] = []
    for placed in reply.pods:
        pod = emulator.pod("default", placed.name)
        claim = emulator.claim("default", f"{placed.name}-gpus")
        assert pod is not None and claim is not None
        booked = migs.parse_slots(pod["metadata"]["annotations"][migs.MIG_ANNOTATION])
        chosen = [names[i] for i in booked[PROFILE]]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [r["device"] for r in results] == chosen  # exactly what placement chose
        assert {(r["driver"], r["pool"]) for r in results} == {("gpu.nvidia.com", "n1")}
        [request] = claim["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "mig.nvidia.com"
        assert request["exactly"]["count"] == 1
        assert uuids[chosen[0]] in request["exactly"]["selectors"][0]["cel"]["expression"]
        [container] = pod["spec"]["containers"]
        assert RESOURCE not in container["resources"].get("limits", {})
        assert GPU not in container["resources"].get("limits", {})
        assert container["resources"]["claims"] == [{"name": "gpufed-gpus"}]
        validate(claim)
        validate(pod)
        chosen_all.extend(chosen)
    assert len(set(chosen_all)) == 2 and names[0] not in chosen_all
    assert len(free_slices(backend)) == 1

    # a restarted agent finds the same devices held
    again = await start(devices="dra")
    await until(lambda: free_slices(again) == free_slices(backend))
