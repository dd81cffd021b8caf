"""place_gang: feasibility, topology, all-or-nothing, min_member, reasons."""

from __future__ import annotations

import copy

import pytest

from broker.api import gangs
from member_agent.inventory import model
from member_agent.placement import gang, indexing
from tests import agentbuilders as b


def _placed(
    result: gang.GangPlacement | gang.NoPlacement,
) -> list[tuple[str, list[tuple[int, int]]]]:
    assert isinstance(result, gang.GangPlacement), result
    return [
        (pod.placement.node, [(slot.index, slot.milli) for slot in pod.placement.gpus])
        for pod in result.pods
    ]


def _ordered(inv: model.Inventory) -> indexing.FreeIndex:
    """An index whose tie-break order is the inventory order (readable tests)."""
    return indexing.FreeIndex.build(inv, order=list(inv.nodes))


@pytest.mark.parametrize(
    ("nodes", "request_", "expected"),
    [
        pytest.param(
            [
                b.node("a", gpus=4, used={0: 1000, 1: 1000, 2: 1000}),
                b.node("b", gpus=4, used={1: 1000}),
            ],
            b.gang(b.shape(2)),
            [("b", [(0, 1000), (2, 1000)])],
            id="whole-GPU pod takes the lowest free GPUs of one node",
        ),
        pytest.param(
            [b.node("a", gpus=2, used={0: 400}), b.node("b", gpus=2)],
            b.gang(b.shape(1, milli=500)),
            [("a", [(0, 500)])],
            id="sharing pod joins the partly used GPU",
        ),
        pytest.param(
            [b.node("a", gpus=2, used={0: 600, 1: 1000}), b.node("b", gpus=2)],
            b.gang(b.shape(1, milli=500)),
            [("b", [(0, 500)])],
            id="sharing pod skips a GPU with too little left",
        ),
        pytest.param(
            [b.node("a", model_name="A100"), b.node("b", model_name="H100")],
            b.gang(b.shape(1, models=("H100",))),
            [("b", [(0, 1000)])],
            id="models list keeps the pod to H100",
        ),
        pytest.param(
            [b.node("a", gpu_memory=40_000), b.node("b", gpu_memory=80_000)],
            b.gang(b.shape(1, gpu_memory=60_000)),
            [("b", [(0, 1000)])],
            id="min GPU memory skips the 40 GB node",
        ),
        pytest.param(
            [b.node("a", cpu_free=500), b.node("b")],
            b.gang(b.shape(1, cpu=4000)),
            [("b", [(0, 1000)])],
            id="node without the CPU is skipped",
        ),
        pytest.param(
            [b.node("a", memory_free=100), b.node("b")],
            b.gang(b.shape(1, memory=4000)),
            [("b", [(0, 1000)])],
            id="node without the memory is skipped",
        ),
        pytest.param(
            [b.node("a", ready=False), b.node("b")],
            b.gang(b.shape(1)),
            [("b", [(0, 1000)])],
            id="not ready node is skipped",
        ),
        pytest.param(
            [
                b.node("a", island=4, used={0: 1000, 1: 1000, 4: 1000, 5: 1000}),
                b.node("b", island=4),
            ],
            b.gang(b.shape(4), nvlink="required"),
            [("b", [(0, 1000), (1, 1000), (2, 1000), (3, 1000)])],
            id="NVLink required: 4 GPUs inside one island, not split 2+2",
        ),
        pytest.param(
            [
                b.node("a", island=4, used={0: 1000, 1: 1000, 4: 1000, 5: 1000}),
                b.node("b", island=4),
            ],
            b.gang(b.shape(4)),
            [("a", [(2, 1000), (3, 1000), (6, 1000), (7, 1000)])],
            id="NVLink not asked: the split node is fine",
        ),
        pytest.param(
            [b.node("a", gpus=4), b.node("b", gpus=4)],
            b.gang(b.shape(0, cpu=2000)),
            [("a", [])],
            id="CPU-only pod holds no GPU",
        ),
    ],
)
def test_single_pod_placement(
    nodes: list[model.Node],
    request_: gangs.GangRequest,
    expected: list[tuple[str, list[tuple[int, int]]]],
) -> None:
    inv = b.inventory(*nodes)
    result = gang.place_gang(inv, request_, policy="bestfit", index=_ordered(inv))
    assert _placed(result) == expected


@pytest.mark.parametrize(
    ("nodes", "request_", "expected_nodes"),
    [
        pytest.param(
            [
                b.node("n1", domain="d1", island=8),
                b.node("n2", domain="d2", island=8),
                b.node("n3", domain="d2", island=8),
            ],
            b.gang(b.shape(8), 2, nvlink="required"),
            ["n2", "n3"],
            id="multi-node NVLink gang stays in one domain",
        ),
        pytest.param(
            [
                b.node("n1", rack="r1"),
                b.node("n2", rack="r2", used={0: 1000}),
                b.node("n3", rack="r2"),
                b.node("n4", rack="r3"),
                b.node("n5", rack="r3"),
            ],
            b.gang(b.shape(8), 2, rack="required"),
            ["n4", "n5"],
            id="rack required: both pods in the one rack with two free nodes",
        ),
        pytest.param(
            [b.node("n1", rack="r1"), b.node("n2", rack="r2")],
            b.gang(b.shape(8), 2, rack="preferred"),
            ["n1", "n2"],
            id="rack preferred: no rack holds both, so anywhere",
        ),
        pytest.param(
            [b.node("n1", rack="r1"), b.node("n2", rack="r2"), b.node("n3", rack="r2")],
            b.gang(b.shape(8), 2, rack="preferred"),
            ["n2", "n3"],
            id="rack preferred: one rack first when it fits",
        ),
        pytest.param(
            [b.node("n1"), b.node("n2")],
            b.gang(b.shape(4), 4),
            ["n1", "n1", "n2", "n2"],
            id="four 4-GPU pods fill two nodes",
        ),
        pytest.param(
            [b.node("n1"), b.node("n2")],
            b.gang(b.shape(8), 3, min_member=2),
            ["n1", "n2"],
            id="min_member 2 of 3: the two that fit are placed",
        ),
    ],
)
def test_gang_placement(
    nodes: list[model.Node], request_: gangs.GangRequest, expected_nodes: list[str]
) -> None:
    inv = b.inventory(*nodes)
    result = gang.place_gang(inv, request_, policy="binpack", index=_ordered(inv))
    assert sorted(node for node, _ in _placed(result)) == expected_nodes


@pytest.mark.parametrize(
    ("nodes", "request_", "reason"),
    [
        pytest.param(
            [b.node("n1"), b.node("n2")],
            b.gang(b.shape(8), 4),
            "gang: 4 pods × 8 GPUs need 4 nodes with 8 free, 2 have",
            id="gang of 4 × 8 on two nodes",
        ),
        pytest.param(
            [b.node("n1", model_name="A100")],
            b.gang(b.shape(1, models=("H100",))),
            "gpu model: no node of model H100 (cluster has A100)",
            id="missing model",
        ),
        pytest.param(
            [b.node("n1", gpu_memory=40_000)],
            b.gang(b.shape(1, gpu_memory=80_000)),
            "gpu memory: no node with 80000 MiB per GPU (largest 40000 MiB)",
            id="GPU memory too small",
        ),
        pytest.param(
            [b.node("n1", cpu_free=1000)],
            b.gang(b.shape(1, cpu=8000)),
            "cpu: 1 node(s) have the GPUs for 1 GPU, 0 also have 8000 milli-CPU free (1 needed)",
            id="CPU short",
        ),
        pytest.param(
            [b.node("n1", island=4)],
            b.gang(b.shape(8), nvlink="required"),
            "nvlink: no node has an NVLink island of 8 GPUs",
            id="no island large enough",
        ),
        pytest.param(
            [b.node("n1", rack="r1"), b.node("n2", rack="r2")],
            b.gang(b.shape(8), 2, rack="required"),
            "topology: no single group holds the whole gang (tried 2: rack r1, rack r2)",
            id="rack required but split",
        ),
        pytest.param(
            [b.node("n1", ready=False)],
            b.gang(b.shape(1)),
            "nodes: none of 1 is ready and schedulable",
            id="nothing ready",
        ),
        pytest.param(
            [b.node("cpu1", gpus=0, model_name="")],
            b.gang(b.shape(1)),
            "gpus: no node has 1 GPUs (largest has 0)",
            id="only CPU nodes",
        ),
    ],
)
def test_unplaceable_reasons_and_nothing_held(
    nodes: list[model.Node], request_: gangs.GangRequest, reason: str
) -> None:
    inv = b.inventory(*nodes)
    before = copy.deepcopy(inv)
    result = gang.place_gang(inv, request_)
    assert isinstance(result, gang.NoPlacement)
    assert reason in result.reasons
    assert list(result.reasons) == sorted(result.reasons)
    assert inv == before


def test_placement_leaves_inventory_untouched_and_applies_cleanly() -> None:
    inv = b.inventory(b.node("n1"), b.node("n2"))
    before = copy.deepcopy(inv)
    result = gang.place_gang(inv, b.gang(b.shape(4), 3))
    assert isinstance(result, gang.GangPlacement)
    assert inv == before
    for pod in result.pods:
        inv.apply(pod.placement, cpu_milli=pod.shape.cpu_milli, memory_mib=pod.shape.memory_mib)
    assert sum(n.whole_free for n in inv) == 4


def test_kept_index_sees_refreshed_nodes() -> None:
    inv = b.inventory(b.node("n1", gpus=2), b.node("n2", gpus=2))
    index = _ordered(inv)
    first = gang.place_gang(inv, b.gang(b.shape(2)), policy="firstfit", index=index)
    assert isinstance(first, gang.GangPlacement)
    pod = first.pods[0]
    inv.apply(pod.placement, cpu_milli=pod.shape.cpu_milli, memory_mib=pod.shape.memory_mib)
    index.refresh(inv.nodes[pod.placement.node])
    second = gang.place_gang(inv, b.gang(b.shape(2)), policy="firstfit", index=index)
    assert _placed(second) == [("n2", [(0, 1000), (1, 1000)])]
    third = gang.place_gang(inv, b.gang(b.shape(2), job_id="j3"), policy="firstfit", index=index)
    inv.apply(second.pods[0].placement)  # type: ignore[union-attr]
    index.refresh(inv.nodes["n2"])
    assert isinstance(third, gang.GangPlacement)
    assert isinstance(gang.place_gang(inv, b.gang(b.shape(1)), index=index), gang.NoPlacement)
