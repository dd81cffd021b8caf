"""The simulated cluster: nodes from YAML, pods that run, finish, fail and free their GPUs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from broker.api import status
from member_agent.cluster import base, errors
from member_agent.cluster.simulated import backend as simulated
from tests import agentbuilders

POOL = """
pools:
  - name: gpu
    count: 4
    gpu_product: NVIDIA-H100-80GB-HBM3
    gpus_per_node: 8
    gpu_memory_mib: 81559
    cpu: 100
    memory: 1Ti
    nvlink_island: 8
"""


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param(("count: 4", "count: 0"), "pools[0].count", id="no nodes"),
        pytest.param(("memory: 1Ti", "memory: lots"), "pools[0].memory", id="bad memory"),
        pytest.param(("    cpu: 100\n", ""), "pools[0].cpu", id="cpu missing"),
        pytest.param(
            ("nvlink_island: 8", "nvlink_island: 16"), "nvlink_island", id="island too big"
        ),
        pytest.param(("nvlink_island: 8", "nvlnk_island: 8"), "pools[0].nvlnk_island", id="typo"),
        pytest.param(("name: gpu", "name: GPU_pool"), "pools[0].name", id="bad name"),
    ],
)
def test_a_bad_cluster_file_names_the_field(
    tmp_path: Path, change: tuple[str, str], field: str
) -> None:
    path = agentbuilders.write_cluster(tmp_path, POOL.replace(*change))
    with pytest.raises(simulated.NodesFileError, match=re.escape(field)):
        simulated.load_pools(path)


@pytest.mark.parametrize(
    ("extra", "racks", "domains"),
    [
        pytest.param("", [""] * 4, [""] * 4, id="no racks"),
        pytest.param(
            "    racks: 2\n", ["gpu-rack-0"] * 2 + ["gpu-rack-1"] * 2, [""] * 4, id="2 racks"
        ),
        pytest.param(
            "    nodes_per_rack: 3\n",
            ["gpu-rack-0"] * 3 + ["gpu-rack-1"],
            [""] * 4,
            id="3 per rack",
        ),
        pytest.param(
            "    nvlink_domain_nodes: 2\n",
            [""] * 4,
            ["gpu-nvl-0"] * 2 + ["gpu-nvl-1"] * 2,
            id="NVLink domains of 2 nodes",
        ),
    ],
)
def test_pools_become_nodes(
    tmp_path: Path, extra: str, racks: list[str], domains: list[str]
) -> None:
    nodes = simulated.build_nodes(
        simulated.load_pools(agentbuilders.write_cluster(tmp_path, POOL + extra))
    )
    assert [n.name for n in nodes] == ["gpu-000", "gpu-001", "gpu-002", "gpu-003"]
    assert [n.rack for n in nodes] == racks
    assert [n.nvlink_domain for n in nodes] == domains
    assert nodes[0].memory_mib == 1024 * 1024
    assert nodes[0].cpu_milli == 100_000
    assert nodes[0].labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_the_demo_clusters_load() -> None:
    root = Path(__file__).resolve().parents[4] / "config" / "clusters"
    gpus = {
        path.stem: sum(n.gpu_count for n in simulated.build_nodes(simulated.load_pools(path)))
        for path in sorted(root.glob("*.yaml"))
    }
    assert gpus == {"a100": 192, "h100": 128, "inference": 352}


def request(
    name: str, node: str = "h100-000", *, gpus: int = 8, annotations: dict[str, str] | None = None
) -> base.PodRequest:
    return base.PodRequest(
        namespace="default",
        name=name,
        job_id="job-1",
        task="worker",
        queue="q",
        node=node,
        gpus=tuple(status.GPUSlot(index=i) for i in range(gpus)),
        cpu_milli=1000,
        memory_mib=1024,
        template={},
        annotations={f"gpufed.io/{k}": v for k, v in (annotations or {}).items()},
    )


async def phases(backend: simulated.SimulatedBackend, count: int) -> list[tuple[str, str, str]]:
    events = backend.events()
    out: list[tuple[str, str, str]] = []
    async with asyncio.timeout(5):
        while len(out) < count:
            event = await anext(events)
            if isinstance(event, base.PodEvent):
                out.append((event.name, event.phase.value, event.reason))
    return out


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param(
            {"sim-duration": "0.02"},
            [("p", "Pending", ""), ("p", "Running", ""), ("p", "Succeeded", "")],
            id="runs then succeeds",
        ),
        pytest.param(
            {"sim-duration": "0.02", "sim-outcome": "Failed:OOMKilled"},
            [("p", "Pending", ""), ("p", "Running", ""), ("p", "Failed", "OOMKilled")],
            id="runs then is OOM killed",
        ),
        pytest.param(
            {"sim-outcome": "Failed"},
            [("p", "Pending", ""), ("p", "Running", ""), ("p", "Failed", "Error")],
            id="fails at start without a duration",
        ),
        pytest.param(
            {"sim-duration": "0.02", "sim-outcome": "Failed:NodeLost@1", "attempt": "1"},
            [("p", "Pending", ""), ("p", "Running", ""), ("p", "Failed", "NodeLost")],
            id="fails on the attempt it names",
        ),
        pytest.param(
            {"sim-duration": "0.02", "sim-outcome": "Failed:NodeLost@1"},
            [("p", "Pending", ""), ("p", "Running", ""), ("p", "Failed", "NodeLost")],
            id="a pod without attempt is a first attempt",
        ),
        pytest.param(
            {"sim-duration": "0.02", "sim-outcome": "Failed:NodeLost@1,3", "attempt": "2"},
            [("p", "Pending", ""), ("p", "Running", ""), ("p", "Succeeded", "")],
            id="succeeds on another attempt",
        ),
    ],
)
async def test_a_pod_runs_and_ends(
    tmp_path: Path, annotations: dict[str, str], expected: list[tuple[str, str, str]]
) -> None:
    backend = agentbuilders.small_backend(tmp_path)
    await backend.create_pod(request("p", annotations=annotations))
    assert backend.inventory().nodes["h100-000"].whole_free == 0
    assert await phases(backend, 3) == expected
    # a finished pod holds no GPU
    assert backend.inventory().nodes["h100-000"].whole_free == 8
    assert [p.phase for p in backend.pods_of("job-1")] == [status.PodPhase(expected[-1][1])]
    await backend.close()


@pytest.mark.looptime  # its start delay and the while it runs pass on the fake loop time
async def test_a_pod_without_duration_runs_until_deleted(tmp_path: Path) -> None:
    backend = agentbuilders.small_backend(tmp_path)
    await backend.create_pod(request("p", gpus=4))
    assert await phases(backend, 2) == [("p", "Pending", ""), ("p", "Running", "")]
    await asyncio.sleep(0.05)
    assert backend.pods_of("job-1")[0].phase == status.PodPhase.RUNNING
    node = backend.inventory().nodes["h100-000"]
    assert (node.whole_free, node.cpu_free) == (4, 199_000)
    await backend.delete_pod("default", "p", grace_seconds=30)
    assert await phases(backend, 1) == [("p", "Deleted", "")]
    assert (node.whole_free, node.cpu_free) == (8, 200_000)
    assert backend.pods_of("job-1") == []
    # deleting a missing pod is not an error
    await backend.delete_pod("default", "p", grace_seconds=0)
    await backend.close()


@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        pytest.param(
            request("a", gpus=8), request("b", gpus=1), "GPU 0 of h100-000", id="GPU taken"
        ),
        pytest.param(
            request("a", gpus=1), request("a", "h100-001", gpus=1), "exists", id="same name"
        ),
        pytest.param(request("a", gpus=1), request("b", "gone", gpus=1), "not found", id="no node"),
        pytest.param(
            request("a", gpus=1),
            request("b", gpus=1, annotations={"sim-outcome": "Failed@first"}),
            "not a list of attempts",
            id="outcome for attempts that are no numbers",
        ),
    ],
)
async def test_a_create_that_cannot_be_done_raises(
    tmp_path: Path, first: base.PodRequest, second: base.PodRequest, match: str
) -> None:
    backend = agentbuilders.small_backend(tmp_path)
    await backend.create_pod(first)
    with pytest.raises(errors.PermanentBackendError, match=match):
        await backend.create_pod(second)
    assert len(backend.pods()) == 1
    await backend.close()


async def test_creates_fail_when_injected(tmp_path: Path) -> None:
    backend = agentbuilders.small_backend(tmp_path)
    backend.fail_creates_after(1)
    await backend.create_pod(request("a", gpus=1))
    with pytest.raises(errors.BackendError, match="injected"):
        await backend.create_pod(request("b", gpus=1, node="h100-001"))
    await backend.create_pod(request("c", gpus=1, node="h100-001"))
    assert sorted(p.request.name for p in backend.pods()) == ["a", "c"]
    await backend.close()


async def test_a_node_that_goes_not_ready_fails_its_pods(tmp_path: Path) -> None:
    backend = agentbuilders.small_backend(tmp_path)
    await backend.create_pod(request("a", gpus=2))
    await backend.create_pod(request("b", "h100-001", gpus=2))
    await phases(backend, 4)  # both pending and running
    backend.set_node_ready("h100-000", False)
    assert await phases(backend, 1) == [("a", "Failed", "NodeLost")]
    node = backend.inventory().nodes["h100-000"]
    assert not node.available
    assert {p.name: p.phase for p in backend.pods_of("job-1")} == {
        "a": status.PodPhase.FAILED,
        "b": status.PodPhase.RUNNING,
    }
    with pytest.raises(errors.PermanentBackendError, match="NotReady"):
        await backend.create_pod(request("c", gpus=1))
    backend.set_node_ready("h100-000", True)
    assert backend.inventory().nodes["h100-000"].available
    await backend.close()
