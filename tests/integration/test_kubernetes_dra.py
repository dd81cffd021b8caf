"""The Kubernetes backend in DRA mode (`devices="dra"`) against kmock's emulator over real HTTP:
the inventory is what the ResourceSlices publish, every pod holds exactly the devices placement
chose through a ResourceClaim allocated and reserved as the scheduler would, sharing pods share
one claim with the driver's sharing configuration, and the claims and pods are valid
Kubernetes 1.34 objects (kubernetes-validate's OpenAPI schemas)."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from broker.api import jobs, messages
from member_agent.cluster import base, errors
from member_agent.cluster.kubernetes import devices, retrying
from member_agent.inventory import summary
from tests import kubeemulator
from tests.conftest_kube import Kube, KubeAgent, Start, gpu_job
from tests.kubeemulator import GPU, H100, next_event, until

KUBERNETES = "1.34"
CLAIM_REF = "gpufed-gpus"


def validate(obj: dict[str, Any]) -> None:
    """A valid object of Kubernetes 1.34 (the server-set fields, uid and the like, too)."""
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def devices_of(claim: dict[str, Any]) -> list[str]:
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


def uid_of(emulator: kubeemulator.Emulator, pod: str, namespace: str = "default") -> str:
    found = emulator.pod(namespace, pod)
    assert found is not None, pod
    return str(found["metadata"]["uid"])


# -- the inventory: what the slices publish --------------------------------------------------


@pytest.mark.parametrize(
    ("slice_args", "node_args", "expected"),
    [
        pytest.param(
            {},
            {},
            {"model": H100, "gpu_count": 8, "gpu_memory_mib": 81559, "free": [1000] * 8},
            id="NVIDIA's driver: gpu-<minor>, productName, memory capacity",
        ),
        pytest.param(
            {"product": "NVIDIA L4", "memory": "23034Mi", "gpus": 4},
            {"product": "", "gpus": 0, "labels": {}},
            {"model": "NVIDIA-L4", "gpu_count": 4, "gpu_memory_mib": 23034},
            id="no GFD labels: the model from productName, as GFD writes it",
        ),
        pytest.param(
            {"indices": [0, 1, 3], "publish_index": True},
            {},
            {"gpu_count": 4, "free": [1000, 1000, 0, 1000]},
            id="a GPU the driver does not publish counts as taken",
        ),
        pytest.param(
            {"gpus": 4, "mig": 3, "tainted": (1,)},
            {},
            {"gpu_count": 4, "free": [1000, 0, 1000, 1000]},
            id="MIG devices are not whole GPUs, a tainted GPU is taken",
        ),
        pytest.param(
            {"clique": "8b1c2f.7"},
            {},
            {"nvlink_domain": "8b1c2f.7"},
            id="the NVLink clique where it is published",
        ),
        pytest.param(
            {"driver": "gpu.example.com"},
            {},
            {"gpu_count": 0, "model": H100},
            id="another driver's slice is not read; nvidia.com/gpu allocatable neither",
        ),
    ],
)
async def test_the_inventory_is_built_from_the_resource_slices(
    dra: Kube,
    start: Start,
    slice_args: dict[str, Any],
    node_args: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    emulator, _ = dra
    await emulator.add_node("n1", **node_args)
    body = await emulator.add_slice("n1", **slice_args)
    validate(body)  # the emulated slices are real ResourceSlices
    backend = await start(devices="dra")
    node = backend.inventory().nodes["n1"]
    for attr, value in expected.items():
        actual = node.gpu_free if attr == "free" else getattr(node, attr)
        assert actual == value, attr


async def test_slices_are_watched_and_the_newest_generation_counts(dra: Kube, start: Start) -> None:
    emulator, _ = dra
    await emulator.add_node("n1", gpus=8)
    await emulator.add_node("n2", gpus=8)
    await emulator.add_slice("n1", gpus=8)
    backend = await start(devices="dra")
    stream = backend.events()
    await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))
    assert backend.inventory().nodes["n2"].gpu_count == 0  # no slice yet
    await emulator.add_slice("n2", gpus=4)
    await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))
    assert backend.inventory().nodes["n2"].gpu_count == 4
    # the driver republishes n1's pool: generation 2 replaces generation 1 (7 GPUs now)
    await emulator.add_slice("n1", gpus=7, generation=2, name="n1-gpu.nvidia.com-g2")
    await until(lambda: backend.inventory().nodes["n1"].gpu_count == 7)
    await emulator.delete_slice("n1-gpu.nvidia.com-x7k2p")
    await emulator.delete_slice("n1-gpu.nvidia.com-g2")
    await until(lambda: backend.inventory().nodes["n1"].gpu_count == 0)
    model = summary.summarise(backend.inventory()).model(H100)
    assert model is not None and model.total_gpus == 4


async def test_the_attribute_names_are_configurable(dra: Kube, start: Start) -> None:
    emulator, _ = dra
    await emulator.add_node("n1", product="", labels={})
    body = kubeemulator.slice_body("n1", gpus=2, driver="gpu.example.com")
    for device in body["spec"]["devices"]:
        attributes = device["attributes"]
        attributes["gpu.example.com/model"] = attributes.pop("productName")
        attributes["slot"] = {"int": 5 - int(device["name"].split("-")[1])}
    await emulator._send("POST", "/apis/resource.k8s.io/v1/resourceslices", body)
    keys = devices.DeviceKeys.from_mapping(
        {"driver": "gpu.example.com", "product": "model", "index": "slot"}
    )
    backend = await start(devices="dra", device_keys=keys)
    node = backend.inventory().nodes["n1"]
    assert (node.model, node.gpu_count, node.gpu_free) == (
        "NVIDIA-H100-80GB-HBM3",
        6,
        [0] * 4 + [1000] * 2,
    )
    with pytest.raises(ValueError, match="unknown"):
        devices.DeviceKeys.from_mapping({"prodcut": "x"})


async def test_claims_other_schedulers_allocated_hold_their_devices(
    dra: Kube, start: Start
) -> None:
    emulator, _ = dra
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    await emulator.add_allocated_claim("other-team", "notebook", "n1", ["gpu-0", "gpu-5"])
    backend = await start(devices="dra")
    assert backend.inventory().nodes["n1"].gpu_free == [0] + [1000] * 4 + [0] + [1000] * 2
    await emulator.add_allocated_claim("other-team", "later", "n1", ["gpu-7"])
    await until(lambda: backend.inventory().nodes["n1"].gpu_free[7] == 0)
    path = "/apis/resource.k8s.io/v1/namespaces/other-team/resourceclaims/notebook"
    await emulator._send("DELETE", path)
    await until(lambda: backend.inventory().nodes["n1"].whole_free == 7)


# -- claims allocated to the devices placement chose -----------------------------------------


async def test_a_gangs_pods_hold_exactly_the_gpus_placement_chose(dra: Kube, start: Start) -> None:
    emulator, _ = dra
    uuids: dict[tuple[str, str], str] = {}
    for name in ("n1", "n2"):
        await emulator.add_node(name)
        published = await emulator.add_slice(name)
        for device in published["spec"]["devices"]:
            uuids[(name, device["name"])] = device["attributes"]["uuid"]["string"]
    # someone else's pods hold GPUs 1 and 2 of n1 and 4 of n2: placement has to go around them
    await emulator.add_allocated_claim("other-team", "a", "n1", ["gpu-1", "gpu-2"])
    await emulator.add_allocated_claim("other-team", "b", "n2", ["gpu-4"])
    backend = await start(devices="dra")
    agent = KubeAgent(backend)
    job = gpu_job("train", replicas=2, containers=[("trainer", 3), ("sidecar", 1)])
    reply = await agent.offer("j1", job)
    assert isinstance(reply, messages.Accepted)
    assert len(reply.pods) == 2
    for placed in reply.pods:
        chosen = [slot.index for slot in placed.gpus]
        assert len(chosen) == 4
        pod = emulator.pod("default", placed.name)
        claim = emulator.claim("default", f"{placed.name}-gpus")
        assert pod is not None and claim is not None
        # the claim is allocated to exactly the chosen GPUs of the pod's node, per container
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["request"], r["device"]) for r in results] == [
            *(("trainer", f"gpu-{i}") for i in chosen[:3]),
            ("sidecar", f"gpu-{chosen[3]}"),
        ]
        assert {(r["driver"], r["pool"]) for r in results} == {("gpu.nvidia.com", placed.node)}
        terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
        assert terms[0]["matchFields"][0]["values"] == [placed.node]
        # reserved for the pod, owned by it, protected as the scheduler protects it
        uid = pod["metadata"]["uid"]
        assert claim["status"]["reservedFor"] == [
            {"resource": "pods", "name": placed.name, "uid": uid}
        ]
        [owner] = claim["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("Pod", uid, True)
        assert claim["metadata"]["finalizers"] == [kubeemulator.DELETE_PROTECTION]
        # the spec says what the allocation does: the same devices, by UUID
        for request in claim["spec"]["devices"]["requests"]:
            expression = request["exactly"]["selectors"][0]["cel"]["expression"]
            picked = [r["device"] for r in results if r["request"] == request["name"]]
            assert all(uuids[(placed.node, name)] in expression for name in picked)
            assert request["exactly"]["count"] == len(picked)
        # the pod is bound to its node and holds its GPUs through the claim only
        spec = pod["spec"]
        assert spec["nodeName"] == placed.node
        assert spec["resourceClaims"] == [
            {"name": CLAIM_REF, "resourceClaimName": f"{placed.name}-gpus"}
        ]
        for container in spec["containers"]:
            assert GPU not in container["resources"].get("limits", {})
        assert [c["resources"]["claims"] for c in spec["containers"]] == [
            [{"name": CLAIM_REF, "request": "trainer"}],
            [{"name": CLAIM_REF, "request": "sidecar"}],
        ]
        validate(claim)
        validate(pod)
    taken = {(p.node, s.index) for p in reply.pods for s in p.gpus}
    assert not taken & {("n1", 1), ("n1", 2), ("n2", 4)}
    claims_watch = backend.watches[-1]
    assert claims_watch.kind == "resourceclaims"
    await until(lambda: claims_watch.resource_version == str(emulator.version))
    assert sum(n.whole_free for n in backend.inventory()) == 16 - 3 - 8  # once each

    # a restarted agent finds the job and its GPUs in the pods
    again = await start(devices="dra")
    assert again.held_jobs()["j1"].gpus == 8
    assert [n.gpu_free for n in again.inventory()] == [n.gpu_free for n in backend.inventory()]


async def test_a_cpu_only_pod_gets_no_claim(dra: Kube, start: Start) -> None:
    emulator, _ = dra
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    document = gpu_job(gpus=2).model_dump(mode="json", by_alias=True)
    launcher = copy.deepcopy(document["spec"]["tasks"][0])
    launcher["name"] = "launcher"
    launcher["template"]["spec"]["containers"][0]["resources"]["limits"] = {}
    document["spec"]["tasks"].append(launcher)
    job = jobs.GPUJob.model_validate(document)
    reply = await KubeAgent(await start(devices="dra")).offer("j1", job)
    assert isinstance(reply, messages.Accepted)
    pod = emulator.pod("default", "j1-launcher-0")
    assert pod is not None and "resourceClaims" not in pod["spec"]
    assert [c["metadata"]["name"] for c in emulator.claims()] == ["j1-worker-0-gpus"]


@pytest.mark.parametrize(
    ("annotations", "strategy"),
    [
        pytest.param({}, "TimeSlicing", id="time-slicing by default"),
        pytest.param({"gpufed.io/gpu-sharing": "mps"}, "MPS", id="MPS when the job asks"),
    ],
)
async def test_two_half_gpu_pods_share_one_gpu_through_one_claim(
    dra: Kube, start: Start, annotations: dict[str, str], strategy: str
) -> None:
    emulator, _ = dra
    await emulator.add_node("n1", gpus=1)
    await emulator.add_slice("n1", gpus=1)
    backend = await start(devices="dra")
    agent = KubeAgent(backend)
    half = {"gpufed.io/gpu-milli": "500", **annotations}
    first = await agent.offer("j1", gpu_job("a", annotations=half))
    second = await agent.offer("j2", gpu_job("b", annotations=half))
    assert isinstance(first, messages.Accepted) and isinstance(second, messages.Accepted)
    [claim] = emulator.claims()
    sharing = annotations.get("gpufed.io/gpu-sharing", "timeslice")
    assert claim["metadata"]["name"] == f"gpufed-n1-gpu0-{sharing}"
    assert devices_of(claim) == ["gpu-0"]
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": strategy},
    }
    opaque = {"driver": "gpu.nvidia.com", "parameters": parameters}
    assert claim["spec"]["devices"]["config"] == [{"requests": ["gpu"], "opaque": opaque}]
    assert claim["status"]["allocation"]["devices"]["config"] == [
        {"source": "FromClaim", "requests": ["gpu"], "opaque": opaque}
    ]
    pods = ["j1-worker-0", "j2-worker-0"]
    uids = [uid_of(emulator, pod) for pod in pods]
    assert [(r["name"], r["uid"]) for r in claim["status"]["reservedFor"]] == list(
        zip(pods, uids, strict=True)
    )
    assert [o["uid"] for o in claim["metadata"]["ownerReferences"]] == uids
    assert not any(o.get("controller") for o in claim["metadata"]["ownerReferences"])
    for name in pods:
        pod = emulator.pod("default", name)
        assert pod is not None
        assert pod["spec"]["resourceClaims"][0]["resourceClaimName"] == claim["metadata"]["name"]
        validate(pod)
    validate(claim)
    assert backend.inventory().nodes["n1"].gpu_free == [0]

    # the claim stays while one of its pods does, and goes with the last
    await agent.cancel("j1")
    assert emulator.claim("default", claim["metadata"]["name"]) is not None
    await agent.cancel("j2")
    await until(lambda: emulator.claims() == [])


async def test_pods_of_two_namespaces_cannot_share_one_claim(dra: Kube, start: Start) -> None:
    emulator, _ = dra
    await emulator.add_node("n1", gpus=1)
    await emulator.add_slice("n1", gpus=1)
    agent = KubeAgent(await start(devices="dra"))
    half = {"gpufed.io/gpu-milli": "500"}
    first = await agent.offer("j1", gpu_job("a", annotations=half, namespace="team-a"))
    second = await agent.offer("j2", gpu_job("b", annotations=half, namespace="team-b"))
    assert isinstance(first, messages.Accepted)
    assert isinstance(second, messages.Rejected)
    assert "shared by pods of namespace team-a" in second.reasons[0]
    assert len(emulator.claims()) == 1
    bad = await agent.offer("j3", gpu_job("c", annotations={**half, "gpufed.io/gpu-sharing": "x"}))
    assert isinstance(bad, messages.Rejected) and "not one of mps, timeslice" in bad.reasons[0]


# -- failures: nothing is left behind --------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "plural", "nth"),
    [
        pytest.param("create", "pods", 2, id="the second pod's create fails"),
        pytest.param("create", "resourceclaims", 2, id="the second claim's create fails"),
        pytest.param("update", "resourceclaims", 3, id="the second claim's reservation fails"),
    ],
)
async def test_a_failed_gang_leaves_no_pod_and_no_claim(
    dra: Kube, start: Start, action: str, plural: str, nth: int
) -> None:
    emulator, _ = dra
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    backend = await start(devices="dra", retry=retrying.NO_RETRY)  # a pod's 500 not retried
    agent = KubeAgent(backend)
    emulator.fail(action, plural, nth=nth, status=500)
    reply = await agent.offer("j1", gpu_job(gpus=4, replicas=2))
    assert isinstance(reply, messages.Rejected)
    assert agent.handler.offers == {"binding_failed": 1}
    assert emulator.pods() == []
    assert emulator.requests_of("delete", "resourceclaims"), "a claim was created and deleted"
    await until(lambda: emulator.claims() == [])
    await until(lambda: backend.inventory().nodes["n1"].whole_free == 8)


async def test_a_reservation_that_conflicts_is_computed_again(dra: Kube, start: Start) -> None:
    """Another writer (the resourceclaim controller) changed the claim between the agent's
    read and its write: the write is refused (409) and made again on the claim as it is."""
    emulator, _ = dra
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    agent = KubeAgent(await start(devices="dra"))
    emulator.fail("update", "resourceclaims", nth=1, status=409)
    reply = await agent.offer("j1", gpu_job(gpus=2))
    assert isinstance(reply, messages.Accepted)
    [claim] = emulator.claims()
    assert devices_of(claim) == [f"gpu-{s.index}" for s in reply.pods[0].gpus]
    assert claim["status"]["reservedFor"][0]["uid"] == uid_of(emulator, "j1-worker-0")
    assert len(emulator.requests_of("fetch", "resourceclaims")) == 1  # read again once
    assert len(emulator.requests_of("update", "resourceclaims")) == 3  # refused, then both


# -- the API version ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("served", "expected"),
    [
        pytest.param(("v1", "v1beta2"), "v1", id="1.34: v1"),
        pytest.param(("v1beta2",), "v1beta2", id="1.33: v1beta2"),
    ],
)
async def test_the_api_version_is_the_one_the_server_offers(
    kube: Kube, start: Start, served: tuple[str, ...], expected: str
) -> None:
    emulator, _ = kube
    emulator.declare_dra(served)
    await emulator.add_node("n1")
    await emulator.add_slice("n1", version=expected)
    backend = await start(devices="dra")
    assert backend.resource_api_version == expected
    assert backend.inventory().nodes["n1"].gpu_count == 8
    reply = await KubeAgent(backend).offer("j1", gpu_job(gpus=2))
    assert isinstance(reply, messages.Accepted)
    [claim] = emulator.claims()
    assert claim["apiVersion"] == f"resource.k8s.io/{expected}"
    paths = {r.url.path for r in emulator.requests_of("create", "resourceclaims")}
    assert paths == {f"/apis/resource.k8s.io/{expected}/namespaces/default/resourceclaims"}
    validate(claim)


@pytest.mark.parametrize(
    ("served", "message"),
    [
        pytest.param(("v1beta1",), "offers resource.k8s.io v1beta1", id="1.32: v1beta1 only"),
        pytest.param((), "offers no resource.k8s.io API", id="no DRA at all"),
    ],
)
async def test_a_server_without_a_usable_dra_api_fails_at_start(
    kube: Kube, start: Start, served: tuple[str, ...], message: str
) -> None:
    emulator, _ = kube
    emulator.declare_dra(served)
    with pytest.raises(errors.PermanentBackendError, match=message):
        await start(devices="dra")


# -- what a real control plane does to claims ------------------------------------------------


async def test_a_claim_is_owned_by_its_pod_without_needing_pods_finalizers(
    dra: Kube, start: Start
) -> None:
    """Where OwnerReferencesPermissionEnforcement runs (OpenShift; the emulator enforces it), an
    owner reference with blockOwnerDeletion needs `update` on pods/finalizers, which the chart
    does not grant: the claim names its pod as owner without it, and still goes with it."""
    emulator, _ = dra
    assert emulator.enforce_owner_refs
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    backend = await start(devices="dra")
    reply = await KubeAgent(backend).offer("j1", gpu_job(gpus=2))
    assert isinstance(reply, messages.Accepted), reply
    [claim] = emulator.claims()
    [owner] = claim["metadata"]["ownerReferences"]
    assert owner["uid"] == uid_of(emulator, "j1-worker-0")
    assert "blockOwnerDeletion" not in owner
    # the pod deleted behind the agent's back: the claim is deallocated and collected with it
    await emulator.delete_pod("default", "j1-worker-0")
    await until(lambda: emulator.claims() == [])


async def test_a_shared_claim_joined_after_its_deallocation_is_allocated_again(
    dra: Kube, start: Start
) -> None:
    """The last pod of a shared claim ends: the resourceclaim controller drops it from
    `reservedFor` and clears the allocation. A sharing pod placed on that GPU afterwards joins
    the claim, which is allocated again (to the same GPU) and reserved for it."""
    emulator, _ = dra
    await emulator.add_node("n1", gpus=1)
    await emulator.add_slice("n1", gpus=1)
    backend = await start(devices="dra")
    agent = KubeAgent(backend)
    half = {"gpufed.io/gpu-milli": "500"}
    first = await agent.offer("j1", gpu_job("a", annotations=half))
    assert isinstance(first, messages.Accepted)
    name = "gpufed-n1-gpu0-timeslice"
    before = emulator.claim("default", name)
    assert before is not None
    await emulator.set_pod_phase("default", "j1-worker-0", "Succeeded")

    def deallocated() -> bool:
        claim = emulator.claim("default", name)
        return claim is not None and not (claim.get("status") or {}).get("allocation")

    await until(deallocated)
    await until(lambda: backend.inventory().nodes["n1"].gpu_free == [1000])
    second = await agent.offer("j2", gpu_job("b", annotations=half))
    assert isinstance(second, messages.Accepted), second
    claim = emulator.claim("default", name)
    assert claim is not None
    assert devices_of(claim) == ["gpu-0"]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["j2-worker-0"]
    assert claim["metadata"]["finalizers"] == [kubeemulator.DELETE_PROTECTION]
    assert claim["metadata"]["uid"] == before["metadata"]["uid"]  # joined, not made anew


async def test_a_sharing_pod_joins_the_claim_of_a_gpu_whose_last_pod_is_terminating(
    dra: Kube, start: Start
) -> None:
    """A shared claim's last pod is stopped with a grace period and stays Terminating (its GPU
    still used): a sharing pod placed on that GPU meanwhile joins the claim, which is neither
    being deleted nor deallocated; it goes once its last pod is gone."""
    emulator, _ = dra
    emulator.termination_seconds = 1.0
    await emulator.add_node("n1", gpus=1)
    await emulator.add_slice("n1", gpus=1)
    backend = await start(devices="dra")
    agent = KubeAgent(backend)
    half = {"gpufed.io/gpu-milli": "500"}
    first = await agent.offer("j1", gpu_job("a", annotations=half))
    assert isinstance(first, messages.Accepted)
    cancel = messages.Cancel(job_id="j1", epoch=1, reason="Cancelled", grace_seconds=30)
    await agent.handler.handle_cancel(cancel)
    assert [p["metadata"]["name"] for p in emulator.terminating()] == ["j1-worker-0"]
    second = await agent.offer("j2", gpu_job("b", annotations=half))
    assert isinstance(second, messages.Accepted), second
    await until(lambda: emulator.pod("default", "j1-worker-0") is None)
    claim = emulator.claim("default", "gpufed-n1-gpu0-timeslice")
    assert claim is not None and "deletionTimestamp" not in claim["metadata"]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["j2-worker-0"]
    assert devices_of(claim) == ["gpu-0"]
    await agent.cancel("j2")
    await until(lambda: emulator.claims() == [])
