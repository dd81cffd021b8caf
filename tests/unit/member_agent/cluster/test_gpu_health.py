"""GPU health: what a Kubernetes node or pod says of its GPUs, the inventory without the
unhealthy ones, the health book's failures and cordons, and GPU failures on the simulated
backend failing the gang on them (and only it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from broker.api import inventory as api
from broker.api import messages, status
from broker.jobs import fleet
from member_agent.cluster import base, gpuhealth
from member_agent.cluster.kubernetes import claims, devices, health, objects
from member_agent.cluster.simulated import backend as simulated
from member_agent.cluster.simulated import faults
from member_agent.inventory import summary
from member_agent.placement import gang
from member_agent.session import reporting
from tests import agentbuilders, kubeemulator
from tests.unit.member_agent import harnesses

KEYS = health.HealthKeys()
H100 = kubeemulator.H100


def node(**kwargs: Any) -> dict[str, Any]:
    return kubeemulator.node_body("n1", **kwargs)


def with_condition(kind: str, state: str, message: str) -> dict[str, Any]:
    """A node with a condition node-problem-detector would set."""
    raw = node()
    condition = {"type": kind, "status": state, "reason": "XidError", "message": message}
    raw["status"]["conditions"].append(condition)
    return raw


# -- what a Node says -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(node(), health.NodeHealth(), id="healthy"),
        pytest.param(
            node(allocatable={"nvidia.com/gpu": "6"}) | {},
            health.NodeHealth(
                missing=2, capacity=8, reasons=("nvidia.com/gpu allocatable 6 of 8",)
            ),
            id="the device plugin dropped two GPUs from allocatable",
        ),
        pytest.param(
            node(taints=[{"key": "nvidia.com/gpu-xid", "value": "gpu-3", "effect": "NoSchedule"}]),
            health.NodeHealth(named=frozenset({3}), reasons=("taint nvidia.com/gpu-xid=gpu-3",)),
            id="an XID taint naming GPU 3",
        ),
        pytest.param(
            node(taints=[{"key": "nvidia.com/gpu-xid", "value": "79", "effect": "NoExecute"}]),
            health.NodeHealth(every=True, reasons=("taint nvidia.com/gpu-xid=79",)),
            id="an XID code names no GPU: all of the node's",
        ),
        pytest.param(
            node(labels={"gpufed.io/gpu-unhealthy": "gpu0.gpu5"}),
            health.NodeHealth(
                named=frozenset({0, 5}), reasons=("label gpufed.io/gpu-unhealthy=gpu0.gpu5",)
            ),
            id="a health label naming two GPUs",
        ),
        pytest.param(
            node(labels={"gpufed.io/gpu-unhealthy": "false"}),
            health.NodeHealth(),
            id="a health label saying false",
        ),
        pytest.param(
            node(taints=[{"key": "example.com/maintenance", "effect": "NoSchedule"}]),
            health.NodeHealth(),
            id="another taint is not about GPU health",
        ),
        pytest.param(
            with_condition("GPUUnhealthy", "True", "Xid 79 on gpu-4: fallen off the bus"),
            health.NodeHealth(
                named=frozenset({4}),
                reasons=("condition GPUUnhealthy: Xid 79 on gpu-4: fallen off the bus",),
            ),
            id="a node-problem-detector condition naming GPU 4",
        ),
        pytest.param(
            with_condition("GPUUnhealthy", "False", "no XID seen"),
            health.NodeHealth(),
            id="the condition False",
        ),
    ],
)
def test_what_a_node_says_of_its_gpus(raw: dict[str, Any], expected: health.NodeHealth) -> None:
    if expected.missing:  # the device plugin's capacity stays what the node has
        raw["status"]["capacity"]["nvidia.com/gpu"] = "8"
    assert health.read_node_health(raw, KEYS) == expected


def test_health_taints_take_out_gpus_not_the_node() -> None:
    raw = node(
        taints=[
            {"key": "nvidia.com/gpu-xid", "value": "gpu-3", "effect": "NoSchedule"},
            {"key": "example.com/maintenance", "effect": "NoSchedule"},
        ],
        allocatable={"nvidia.com/gpu": "7"},
    )
    raw["status"]["capacity"]["nvidia.com/gpu"] = "8"
    read = health.without_health_taints(raw, KEYS)
    assert read["spec"]["taints"] == [{"key": "example.com/maintenance", "effect": "NoSchedule"}]
    assert read["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert raw["status"]["allocatable"]["nvidia.com/gpu"] == "7"  # the object is not changed
    custom = health.HealthKeys(taints=("example.com/maintenance",), labels=())
    assert health.read_node_health(raw, custom).every


def test_a_drop_in_allocatable_counts_gpus_not_shared_replicas() -> None:
    keys = objects.LabelKeys()
    whole = node(allocatable={"nvidia.com/gpu": "6"})
    whole["status"]["capacity"]["nvidia.com/gpu"] = "8"
    read, found = health.read_node(whole, keys, KEYS, plugin=True)
    assert read is not None and (read.gpu_count, found.missing) == (8, 2)
    # time-slicing without renaming: nvidia.com/gpu are 4 replicas of each GPU
    sliced = node(allocatable={"nvidia.com/gpu": "6"}, labels={"nvidia.com/gpu.replicas": "4"})
    del sliced["metadata"]["labels"]["nvidia.com/gpu.count"]
    sliced["status"]["capacity"]["nvidia.com/gpu"] = "8"
    read, found = health.read_node(sliced, keys, KEYS, plugin=True)
    assert read is not None and (read.gpu_count, found.missing) == (1, 0)  # as offered


@pytest.mark.parametrize(
    ("found", "free", "ours", "named", "expected"),
    [
        pytest.param(
            health.NodeHealth(missing=1), [1000] * 4, set(), (), {3}, id="one missing: the top"
        ),
        pytest.param(
            health.NodeHealth(missing=2),
            [1000, 0, 0, 0],
            {2, 3},
            (),
            {0, 1},
            id="free GPUs first, then those other workloads hold",
        ),
        pytest.param(
            health.NodeHealth(missing=1),
            [0, 0, 0, 0],
            {0, 1, 2, 3},
            (),
            {3},
            id="all gpufed's: the highest",
        ),
        pytest.param(
            health.NodeHealth(named=frozenset({1}), missing=1),
            [1000] * 4,
            set(),
            (),
            {1},
            id="a named GPU is the missing one",
        ),
        pytest.param(health.NodeHealth(), [1000] * 4, set(), (2,), {2}, id="a DRA device's taint"),
        pytest.param(health.NodeHealth(every=True), [1000] * 3, set(), (), {0, 1, 2}, id="all"),
    ],
)
def test_which_gpus_are_unhealthy(
    found: health.NodeHealth,
    free: list[int],
    ours: set[int],
    named: tuple[int, ...],
    expected: set[int],
) -> None:
    assert health.choose_unhealthy(found, free, ours=ours, named=named) == expected


@pytest.mark.parametrize(
    ("resource", "device_health", "unhealthy"),
    [
        pytest.param("nvidia.com/gpu", "Unhealthy", True, id="device plugin GPU unhealthy"),
        pytest.param("claim:train-0-gpus/main", "Unhealthy", True, id="DRA claim unhealthy"),
        pytest.param("nvidia.com/gpu", "Healthy", False, id="healthy"),
        pytest.param("example.com/nic", "Unhealthy", False, id="not a GPU"),
    ],
)
def test_the_kubelet_reports_a_pods_device_unhealthy(
    resource: str, device_health: str, unhealthy: bool
) -> None:
    pod_status = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "main",
                "allocatedResourcesStatus": [
                    {
                        "name": resource,
                        "resources": [{"resourceID": "GPU-1a2b", "health": device_health}],
                    }
                ],
            }
        ],
    }
    assert health.pod_gpu_unhealthy(pod_status) is unhealthy


def test_a_claims_device_condition_makes_that_device_unhealthy() -> None:
    book = devices.DeviceBook(devices.DeviceKeys())
    book.replace([kubeemulator.slice_body("n1", gpus=2)])

    def entry(device: str, kind: str, state: str) -> dict[str, Any]:
        condition = {"type": kind, "status": state, "message": "Xid 79"}
        return {
            "driver": "gpu.nvidia.com",
            "pool": "n1",
            "device": device,
            "conditions": [condition],
        }

    claim = {
        "status": {
            "devices": [
                entry("gpu-1", "GPUUnhealthy", "True"),
                entry("gpu-0", "Ready", "True"),  # another condition: nothing to do with it
            ]
        }
    }
    sick = claims.sick_devices(claim, ("GPUUnhealthy",))
    assert sick == {("gpu.nvidia.com", "n1", "gpu-1"): "claim condition GPUUnhealthy: Xid 79"}
    assert book.set_claim_health("team/claim:a", sick) == {"n1"}
    assert [d.unhealthy != "" for d in book.devices("n1").values()] == [False, True]
    assert book.set_claim_health("team/claim:a", sick) == set()  # no change
    assert book.set_claim_health("team/claim:a", {}) == {"n1"}  # healthy again
    assert not any(d.unhealthy for d in book.devices("n1").values())


# -- the inventory without them ---------------------------------------------------------------


def test_an_unhealthy_gpu_is_never_free_and_counts_unavailable() -> None:
    inventory = agentbuilders.inventory(
        agentbuilders.node("n1", gpus=4), agentbuilders.node("n2", gpus=4)
    )
    pod = status.PodPlacement(name="p", task="w", node="n1", gpus=[status.GPUSlot(index=1)])
    inventory.apply(pod)
    assert inventory.set_unhealthy("n1", {1, 2}) == {1, 2}
    n1 = inventory.nodes["n1"]
    assert n1.gpu_free == [1000, 0, 0, 1000]
    inventory.release("p")  # the pod on GPU 1 goes: GPU 1 stays out
    assert n1.gpu_free == [1000, 0, 0, 1000]
    with pytest.raises(ValueError, match="GPU 2 of n1 is unhealthy"):  # no new pod there
        slot = status.GPUSlot(index=2)
        inventory.apply(status.PodPlacement(name="q", task="w", node="n1", gpus=[slot]))
    inventory.apply(pod, held=True)  # one the cluster already has there is recorded
    assert n1.gpu_free == [1000, 0, 0, 1000] and "p" in inventory.pods
    inventory.release("p")
    found = summary.summarise(inventory).model("H100")
    assert found is not None
    assert (found.total_gpus, found.free_gpus, found.unavailable_gpus) == (8, 6, 2)
    assert found.nodes_by_free == [0, 0, 1, 0, 1]
    # placement goes around them: two pods of 3 GPUs cannot both go, one goes to n2
    assert isinstance(
        gang.place_gang(inventory, agentbuilders.gang(agentbuilders.shape(3), 2)), gang.NoPlacement
    )
    placed = gang.place_gang(inventory, agentbuilders.gang(agentbuilders.shape(3)))
    assert isinstance(placed, gang.GangPlacement)
    assert [p.placement.node for p in placed.pods] == ["n2"]
    assert inventory.set_unhealthy("n1", ()) == frozenset()  # healthy again: all free
    assert n1.gpu_free == [1000] * 4 and n1.unhealthy_gpus == 0


# -- the health book --------------------------------------------------------------------------


def test_the_book_counts_failures_and_cordons_once_after_the_threshold() -> None:
    cordoned: list[tuple[str, str]] = []
    book = gpuhealth.HealthBook(
        "c1",
        gpuhealth.HealthSettings(auto_cordon=True, cordon_after=2),
        cordon=lambda node, why: cordoned.append((node, why)),
    )
    assert book.observe("n1", {3}) == {3}
    assert book.observe("n1", {3}) == frozenset()  # the same GPU again is no new failure
    assert cordoned == []
    assert book.observe("n1", {3, 5}) == {5}
    assert cordoned == [("n1", "GPUFailed: 2 GPU failures on this node within 1h")]
    book.observe("n1", set())
    book.observe("n1", {0})
    assert len(cordoned) == 1 and book.cordons == 1
    assert (book.gpu_failures, book.unhealthy_gpus()) == (3, {"n1": 1})


def test_without_auto_cordon_nothing_is_cordoned() -> None:
    cordoned: list[str] = []
    book = gpuhealth.HealthBook(
        "c1", gpuhealth.HealthSettings(cordon_after=1), cordon=lambda n, w: cordoned.append(n)
    )
    book.observe("n1", {0, 1})
    assert (cordoned, book.recent_failures("n1")) == ([], 2)
    with pytest.raises(ValueError, match="below 1"):
        gpuhealth.HealthSettings(cordon_after=0)


# -- the simulated backend: a GPU failing under a gang -----------------------------------------


async def test_a_gpu_failing_fails_the_gang_on_it_and_leaves_the_inventory(
    tmp_path: Path,
) -> None:
    harness = harnesses.Harness(tmp_path)
    try:
        j1 = await harness.offer("j1", gpus=4, replicas=2, model=agentbuilders.H100)
        assert isinstance(j1, messages.Accepted)
        j2 = await harness.offer("j2", gpus=2, model=agentbuilders.L4)
        assert isinstance(j2, messages.Accepted)
        running = ("Running", "PodsRunning")
        await harness.pump(lambda: all(running in harness.updates(j) for j in ("j1", "j2")))
        pods = harness.backend.pods_of("j1")
        victim = pods[0]
        others = [p for p in harness.backend.pods() if p.request.job_id != "j1"]
        failed = harness.backend.gpus.fail_gpu(victim.node, victim.gpus[0].index)
        assert failed == 1
        await harness.pump(lambda: ("Failed", gpuhealth.GPU_FAILED) in harness.updates("j1"))
        # the gang fails as a unit: its pods are deleted, the failed one too; other jobs run on
        await harness.pump(lambda: not harness.backend.pods_of("j1"))
        assert all(p.phase == status.PodPhase.RUNNING for p in others)
        node = harness.backend.inventory().nodes[victim.node]
        assert node.unhealthy == {victim.gpus[0].index}
        assert node.gpu_free[victim.gpus[0].index] == 0
        book = harness.backend.gpu_health()
        assert (book.gpu_failures, book.failed_pods, book.cordons) == (1, 1, 0)
    finally:
        await harness.close()


def sim_pod(
    name: str, node: str, *, gpus: list[int], annotations: dict[str, str]
) -> base.PodRequest:
    return base.PodRequest(
        namespace="default",
        name=name,
        job_id=f"job-{name}",
        task="worker",
        queue="q",
        node=node,
        gpus=tuple(status.GPUSlot(index=i) for i in gpus),
        cpu_milli=1000,
        memory_mib=1024,
        template={},
        annotations=annotations,
    )


async def test_a_jobs_annotation_fails_its_gpu_and_auto_cordon_cordons_the_node(
    tmp_path: Path,
) -> None:
    backend = simulated.SimulatedBackend(
        "small",
        simulated.load_pools(agentbuilders.write_cluster(tmp_path)),
        start_delay=0.01,
        health_settings=gpuhealth.HealthSettings(auto_cordon=True, cordon_after=1),
    )
    failing = {faults.SIM_GPU_FAILURE_ANNOTATION: "0.01@1", base.ATTEMPT_ANNOTATION: "1"}
    await backend.create_pod(sim_pod("a", "h100-000", gpus=[2, 3], annotations=failing))
    later = {**failing, base.ATTEMPT_ANNOTATION: "2"}  # a retry: not this attempt
    await backend.create_pod(sim_pod("b", "h100-001", gpus=[0], annotations=later))
    events = backend.events()
    seen: list[tuple[str, str, str]] = []
    async with asyncio.timeout(5):
        while ("a", "Failed", gpuhealth.GPU_FAILED) not in seen:
            event = await anext(events)
            if isinstance(event, base.PodEvent):
                seen.append((event.name, event.phase.value, event.reason))
    inventory = backend.inventory()
    assert inventory.nodes["h100-000"].unhealthy == {2}  # its first GPU
    assert not inventory.nodes["h100-000"].available  # cordoned after one failure
    assert backend.gpu_health().cordoned == {
        "h100-000": "GPUFailed: 1 GPU failures on this node within 1h"
    }
    assert [p.phase for p in backend.pods() if p.request.name == "b"] == [status.PodPhase.RUNNING]
    found = summary.summarise(inventory).model(agentbuilders.H100)
    assert found is not None and found.unavailable_gpus == 8  # the cordoned node's
    with pytest.raises(ValueError, match="no GPU 9"):
        backend.gpus.fail_gpu("h100-001", 9)
    await backend.close()


# -- what the broker is told -------------------------------------------------------------------


async def test_the_summary_carries_gpu_health_only_to_a_broker_that_reads_it() -> None:
    inventory = agentbuilders.inventory(agentbuilders.node("n1", gpus=4))
    book = gpuhealth.HealthBook("c1", gpuhealth.HealthSettings(auto_cordon=True, cordon_after=1))
    reporter = reporting.SummaryReporter(
        lambda: inventory, cluster="c1", health=book.summary, interval=0
    )
    sent: list[messages.Summary] = []
    old = reporter.attach(sent.append)  # a broker of protocol 5: nothing of it on the wire
    assert old.summary.gpu_health is None
    assert "gpu_health" not in messages.encode(old)
    reporter.send_health = True
    first = reporter.attach(sent.append)
    assert first.summary.gpu_health == api.GPUHealth()
    # a GPU fails and the node is cordoned: the summary says both, and the broker shows them
    book.observe("n1", {1})
    inventory.set_unhealthy("n1", {1})
    inventory.nodes["n1"].schedulable = False
    update = reporter.next_message()
    assert update is not None and update.summary.gpu_health == api.GPUHealth(
        unhealthy_gpus=1, cordoned_nodes=["n1"]
    )
    assert messages.decode(messages.encode(update)) == update
    assert reporter.next_message() is None  # nothing changed since
    book.observe("n1", set())  # healthy again: that alone is worth a summary
    inventory.set_unhealthy("n1", ())
    again = reporter.next_message()
    assert again is not None and again.summary.gpu_health == api.GPUHealth(cordoned_nodes=["n1"])

    cluster = fleet.Cluster("c1")
    cluster.apply_summary(first)
    cluster.apply_summary(update)  # a delta: its health replaces the last one's
    fleet_ = fleet.Fleet()
    fleet_.clusters["c1"] = cluster
    [view] = fleet_.views(now=0.0, running={})
    assert (view.unhealthy_gpus, view.cordoned_nodes) == (1, ["n1"])
