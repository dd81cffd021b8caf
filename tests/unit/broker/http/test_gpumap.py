"""The GPU map (`http.gpumap.build_map`): named nodes from the pods the broker placed, the
rest of each model's nodes from the summary's histogram, every node one row."""

from __future__ import annotations

import pytest

from broker.api import status
from broker.api.gpumap import GpuMap
from broker.http import gpumap
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
L4 = "NVIDIA-L4"


def holder(
    job_id: str,
    pods: list[tuple[str, list[tuple[int, int]]]],
    *,
    tenant: str = "team-a",
    model: str = H100,
    phase: status.PodPhase = status.PodPhase.RUNNING,
) -> gpumap.Holder:
    record = status.JobRecord(id=job_id, tenant=tenant, job=make_job(job_id, gpus=1).build())
    record.status.state = status.JobState.RUNNING
    record.status.pods = [
        status.PodStatus(
            name=f"{job_id}-{i}",
            task="worker",
            node=node,
            gpus=[status.GPUSlot(index=index, milli=milli) for index, milli in slots],
            phase=phase,
        )
        for i, (node, slots) in enumerate(pods)
    ]
    return gpumap.Holder(record, {model: 1})


def rows(answer: GpuMap) -> list[tuple[str | None, str]]:
    out: list[tuple[str | None, str]] = [(n.name, n.cells) for n in answer.nodes]
    for group in answer.others:
        out += [(None, group.cells)] * group.count
    return out


@pytest.mark.parametrize(
    ("nodes_by_free", "nodes", "holders", "expected"),
    [
        pytest.param(
            [0, 0, 0, 0, 0, 0, 1, 0, 2],
            3,
            [holder("a", [("n1", [(0, 1000), (1, 1000)])])],
            [("n1", "WWFFFFFF"), (None, "FFFFFFFF"), (None, "FFFFFFFF")],
            id="a 2-GPU pod on one of three nodes: that node named, two free ones from the summary",
        ),
        pytest.param(
            [0, 0, 0, 0, 0, 0, 0, 1, 0],
            1,
            [holder("a", [("n1", [(3, 500)])]), holder("b", [("n1", [(3, 250)])])],
            [("n1", "FFFSFFFF")],
            id="two sharing pods on one GPU: shared, the node's other seven free",
        ),
        pytest.param(
            [0, 0, 0, 0, 1, 0, 0, 0, 0],
            2,
            [],
            [(None, "FFFFOOOO"), (None, "OOOOOOOO")],
            id="no pods: half a node held outside gpufed, a node not ready",
        ),
        pytest.param(
            [0, 0, 0, 0, 0, 0, 0, 0, 1],
            1,
            [holder("a", [("n1", [(0, 1000)])], phase=status.PodPhase.DELETED)],
            [(None, "FFFFFFFF")],
            id="a deleted pod holds nothing",
        ),
    ],
)
def test_every_node_is_one_row(
    nodes_by_free: list[int],
    nodes: int,
    holders: list[gpumap.Holder],
    expected: list[tuple[str | None, str]],
) -> None:
    model = make_model_summary(H100, nodes_by_free=nodes_by_free).model_copy(
        update={"nodes": nodes, "total_gpus": 8 * nodes}
    )
    answer = gpumap.build_map("east", "Ready", make_summary("east", model), holders, sees=bool)
    assert rows(answer) == expected
    assert answer.rows == nodes


def test_job_ids_only_of_the_tenants_the_caller_sees_and_models_apart() -> None:
    summary = make_summary(
        "east",
        make_model_summary(H100, nodes_by_free=[0] * 6 + [1, 0, 0]),
        make_model_summary(L4, nodes_by_free=[0, 0, 0, 1, 0], gpus_per_node=4),
    )
    holders = [
        holder("mine", [("h1", [(0, 1000)])]),
        holder("theirs", [("h1", [(1, 1000)])], tenant="team-b"),
        holder("small", [("l1", [(2, 1000)])], model=L4),
    ]
    answer = gpumap.build_map("east", "Ready", summary, holders, sees=lambda t: t == "team-a")
    by_name = {n.name: n for n in answer.nodes}
    assert (by_name["h1"].cells, by_name["h1"].jobs) == ("WWFFFFFF", ["mine"])
    assert (by_name["l1"].model, by_name["l1"].cells) == (L4, "FFWF")
    assert [(m.model, m.gpus_per_node) for m in answer.models] == [(H100, 8), (L4, 4)]
    assert answer.others == []


def test_no_summary_yet_is_an_empty_map_that_says_so() -> None:
    answer = gpumap.build_map("east", "Connecting", None, [], sees=bool)
    assert answer.rows == 0 and "no summary" in answer.message
