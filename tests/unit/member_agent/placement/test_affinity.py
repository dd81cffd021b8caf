"""The agent honours node selectors and required node affinity on node labels, with Kubernetes
semantics, through the path an offer takes: GPUJob -> gang_request -> place_gang."""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import gangs, jobs
from member_agent.inventory import model
from member_agent.placement import filtering, gang, indexing
from tests import agentbuilders as b
from tests.builders import JobBuilder, expr, make_job

GPU = jobs.GPU_PRODUCT_LABEL
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
GEN = "example.com/generation"
ZONE = "topology.kubernetes.io/zone"


def fleet() -> model.Inventory:
    """Two H100 nodes (zone a, generation 9), two A100 nodes (zone b, generation 8; one of
    them with a non-numeric generation), and a CPU-only node without a zone."""
    return b.inventory(
        b.node("h1", model_name=H100, labels={ZONE: "a", GEN: "9"}),
        b.node("h2", model_name=H100, labels={ZONE: "a", GEN: "9"}),
        b.node("a1", model_name=A100, labels={ZONE: "b", GEN: "8"}),
        b.node("a2", model_name=A100, labels={ZONE: "b", GEN: "ampere"}),
        b.node("cpu", gpus=0, model_name="", labels={"node-role": "cpu"}),
    )


def _feasible(builder: JobBuilder) -> set[str]:
    inv = fleet()
    index = indexing.FreeIndex.build(inv)
    _, _, shape = builder.request().tasks[0]
    demand = filtering.demand_of(shape)
    return {entry.name for entry in index.entries.values() if filtering.fits(entry, demand)}


GPUS = {"h1", "h2", "a1", "a2"}


@pytest.mark.parametrize(
    ("terms", "expected"),
    [
        pytest.param([[expr(GPU, "In", A100)]], {"a1", "a2"}, id="In on the model"),
        pytest.param([[expr(GPU, "NotIn", H100)]], {"a1", "a2"}, id="NotIn on the model"),
        pytest.param([[expr(ZONE, "NotIn", "a")]], {"a1", "a2"}, id="NotIn on a zone"),
        pytest.param([[expr(ZONE, "Exists")]], GPUS, id="Exists"),
        pytest.param([[expr(GEN, "DoesNotExist")]], set(), id="DoesNotExist: GPU nodes have it"),
        pytest.param([[expr(GEN, "Gt", "8")]], {"h1", "h2"}, id="Gt"),
        pytest.param([[expr(GEN, "Lt", "9")]], {"a1"}, id="Lt skips a non-integer label"),
        pytest.param([[expr(ZONE, "In", "c")]], set(), id="In a value no node has"),
        pytest.param(
            [[expr(ZONE, "In", "b"), expr(GEN, "Gt", "7")]], {"a1"}, id="expressions ANDed"
        ),
        pytest.param(
            [[expr(GEN, "Gt", "8")], [expr(GEN, "In", "ampere")]],
            {"h1", "h2", "a2"},
            id="terms ORed",
        ),
    ],
)
def test_matching_nodes(terms: list[list[dict[str, Any]]], expected: set[str]) -> None:
    assert _feasible(make_job(gpus=1).node_affinity(*terms)) == expected


def test_node_selector_and_affinity_both_hold() -> None:
    builder = make_job(gpus=1).node_selector({ZONE: "a"}).node_affinity([expr(GEN, "Lt", "9")])
    assert _feasible(builder) == set()
    assert _feasible(make_job(gpus=1).node_selector({ZONE: "b", GEN: "8"})) == {"a1"}


def test_match_fields_on_the_node_name() -> None:
    doc = make_job(gpus=1).document()
    doc["spec"]["tasks"][0]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [expr("metadata.name", "NotIn", "h1")]}]
        }}
    }  # fmt: skip
    shape = gangs.gang_request("j", jobs.validate_submitted(doc)).tasks[0][2]
    index = indexing.FreeIndex.build(fleet())
    demand = filtering.demand_of(shape)
    fitting = {e.name for e in index.entries.values() if filtering.fits(e, demand)}
    assert fitting == {"h2", "a1", "a2"}


def test_a_cpu_only_pod_may_ask_for_a_node_without_gpus() -> None:
    builder = make_job(gpus=1).task("loader", gpus=0).node_affinity([expr(GPU, "DoesNotExist")])
    inv = fleet()
    result = gang.place_gang(inv, builder.request())
    assert isinstance(result, gang.GangPlacement), result
    nodes = {pod.placement.task: pod.placement.node for pod in result.pods}
    assert nodes["loader"] == "cpu"


def test_the_gang_goes_where_the_affinity_allows() -> None:
    builder = make_job(gpus=8).gang(2).node_affinity([expr(GPU, "NotIn", H100)])
    result = gang.place_gang(fleet(), builder.request())
    assert isinstance(result, gang.GangPlacement), result
    assert sorted(pod.placement.node for pod in result.pods) == ["a1", "a2"]
    # a third pod: the H100 nodes are free, but ruled out
    builder = make_job(gpus=8).gang(3).node_affinity([expr(GPU, "NotIn", H100)])
    result = gang.place_gang(fleet(), builder.request())
    assert isinstance(result, gang.NoPlacement)


@pytest.mark.parametrize(
    ("terms", "reason"),
    [
        pytest.param(
            [[expr(GPU, "NotIn", H100, A100)]],
            f"node affinity: no ready node with GPUs matches {GPU} NotIn",
            id="every model excluded",
        ),
        pytest.param(
            [[expr(ZONE, "In", "c")]],
            f"node affinity: no ready node with GPUs matches {ZONE} In [c]",
            id="a zone no node is in",
        ),
    ],
)
def test_the_rejection_names_the_affinity(terms: list[list[dict[str, Any]]], reason: str) -> None:
    result = gang.place_gang(fleet(), make_job(gpus=1).node_affinity(*terms).request())
    assert isinstance(result, gang.NoPlacement)
    assert any(r.startswith(reason) for r in result.reasons), result.reasons


def test_a_kept_index_follows_relabelled_nodes() -> None:
    inv = fleet()
    index = indexing.FreeIndex.build(inv)
    inv.nodes["h1"].labels = {**inv.nodes["h1"].labels, ZONE: "c"}
    index.refresh(inv.nodes["h1"])
    request = make_job(gpus=1).node_affinity([expr(ZONE, "In", "c")]).request()
    result = gang.place_gang(inv, request, index=index)
    assert isinstance(result, gang.GangPlacement)
    assert [pod.placement.node for pod in result.pods] == ["h1"]


def test_the_model_label_is_the_node_model() -> None:
    """A node whose labels lack the product label (a backend that reads the model from
    another key) still answers to it, with the model the broker knows it by."""
    node = model.Node(name="n", model=H100, gpu_count=8, labels={"other/product": H100})
    assert node.labels[GPU] == H100
