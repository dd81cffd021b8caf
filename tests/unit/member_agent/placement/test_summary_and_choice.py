"""summarise (agent) and the broker's cluster choice over those summaries."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from broker.api import gangs
from broker.api import inventory as api
from broker.planning import planning, snapshot
from member_agent.inventory import model, summary
from tests import agentbuilders as b


def test_summary_counts_nodes_by_free_gpus() -> None:
    inv = b.inventory(
        b.node("a", used={0: 1000, 1: 300}, rack="r1", island=4),
        b.node("b", rack="r1", island=4),
        b.node("c", gpus=2, model_name="T4", cpu_free=4000),
        b.node("d", ready=False),
    )
    result = summary.summarise(inv, seq=3)
    h100 = result.model("H100")
    t4 = result.model("T4")
    assert h100 is not None and t4 is not None
    assert result.seq == 3 and result.cluster == "test"
    assert h100.nodes_by_free[6] == 1 and h100.nodes_by_free[8] == 1
    assert sum(h100.nodes_by_free) == 2  # the not-ready node is not counted
    assert h100.unavailable_gpus == 8
    assert h100.shared_free_milli == 700
    assert h100.largest_free_nvlink_block == 4
    assert h100.racks == {"r1": [0, 0, 0, 0, 0, 0, 1, 0, 1]}
    assert t4.nodes_by_free[2] == 1 and t4.max_free_cpu_milli == 4000
    assert result.fragmentation_milli > 0


def _summary(name: str, by_free: dict[int, int], *, frag: int = 0, shared: int = 0,
             model_name: str = "H100", busy_nodes: int = 0) -> api.ClusterSummary:  # fmt: skip
    histogram = [0] * 9
    for free, count in by_free.items():
        histogram[free] = count
    histogram[0] += busy_nodes
    return api.ClusterSummary(
        cluster=name,
        fragmentation_milli=frag,
        models=[
            api.ModelSummary(
                model=model_name,
                gpus_per_node=8,
                nodes=sum(by_free.values()) + busy_nodes,
                total_gpus=8 * (sum(by_free.values()) + busy_nodes),
                free_gpus=sum(k * v for k, v in by_free.items()),
                nodes_by_free=histogram,
                shared_free_milli=shared,
                max_free_cpu_milli=64_000,
                max_free_memory_mib=512_000,
            )
        ],
    )


def choose(summaries: list[api.ClusterSummary], request: gangs.GangRequest) -> planning.CyclePlan:
    """The broker's own decision for one job (`planning.plan_cycle`) over these summaries."""
    fleet = snapshot.FleetSnapshot.build(
        [snapshot.ClusterCapacity.from_summary(item, healthy=True) for item in summaries]
    )
    job = snapshot.PendingJob(
        job_id=request.job_id, queue="q", priority=0,
        created=datetime(2026, 1, 1, tzinfo=UTC), request=request,
    )  # fmt: skip
    return planning.plan_cycle(fleet, [job])


@pytest.mark.parametrize(
    ("summaries", "request_", "ranked"),
    [
        pytest.param(
            [_summary("big", {8: 3}), _summary("exact", {2: 1, 8: 1})],
            b.gang(b.shape(2)),
            ("exact", "big"),
            id="an exact fit comes first",
        ),
        pytest.param(
            [_summary("one", {8: 1}), _summary("two", {8: 2})],
            b.gang(b.shape(8), 2),
            ("two",),
            id="a gang of 2 × 8 only fits the cluster with two free nodes",
        ),
        pytest.param(
            [_summary("a100", {8: 4}, model_name="A100"), _summary("h100", {8: 1})],
            b.gang(b.shape(1, models=("H100",))),
            ("h100",),
            id="GPU model filter",
        ),
        pytest.param(
            [_summary("whole", {8: 2}), _summary("shared", {8: 2}, shared=600)],
            b.gang(b.shape(1, milli=500)),
            ("shared", "whole"),
            id="a sharing pod goes where a partly used GPU has room",
        ),
        pytest.param(
            [_summary("quiet", {1: 4}), _summary("busy", {1: 4}, busy_nodes=6)],
            b.gang(b.shape(1)),
            ("busy", "quiet"),
            id="equal fit: the busier cluster first (clusters are packed)",
        ),
    ],
)
def test_choose_cluster(
    summaries: list[api.ClusterSummary], request_: gangs.GangRequest, ranked: tuple[str, ...]
) -> None:
    plan = choose(summaries, request_)
    assert [a.cluster for a in plan.assignments] == [ranked[0]]


def test_choose_cluster_says_why_not() -> None:
    plan = choose([_summary("small", {4: 2})], b.gang(b.shape(8)))
    assert plan.assignments == []
    [miss] = plan.unplaceable
    assert miss.reasons == ("small: needs 1 node(s) with 8 free GPU(s) of H100; not enough free",)


def test_summary_then_choice_agrees_with_inventory() -> None:
    full = b.inventory(b.node("x", used={i: 1000 for i in range(8)}))
    full.cluster = "full"
    free = b.inventory(b.node("y"))
    free.cluster = "free"
    plan = choose([summary.summarise(full), summary.summarise(free)], b.gang(b.shape(4)))
    assert [a.cluster for a in plan.assignments] == ["free"]
    assert model.GPU_MILLI == 1000
