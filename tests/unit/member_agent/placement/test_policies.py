"""Each named policy picks what it should on a tiny inventory; FGD's measure is exact."""

from __future__ import annotations

import pytest

from member_agent.inventory import fragmentation, model
from member_agent.placement import gang, indexing, policies, scoring
from tests import agentbuilders as b


# Three 8-GPU nodes: "full" has 2 GPUs free, "half" 4, "idle" 8. Tie-break order: idle, half, full.
def _nodes() -> list[model.Node]:
    return [
        b.node("full", used={i: 1000 for i in range(6)}),
        b.node("idle"),
        b.node("half", used={i: 1000 for i in range(4)}),
    ]


ORDER = ["idle", "half", "full"]

# Expected workload: only 8-GPU pods, so breaking the idle node is what FGD must avoid.
EIGHT_GPU = fragmentation.Workload(
    shapes=(fragmentation.TypicalShape(cpu_milli=0, gpu_milli=1000, gpus=8),)
)


def _choose(policy: scoring.Scorer, pod_gpus: int = 1) -> str:
    inv = b.inventory(*_nodes())
    index = indexing.FreeIndex.build(inv, order=ORDER)
    result = gang.place_gang(inv, b.gang(b.shape(pod_gpus)), policy=policy, index=index)
    assert isinstance(result, gang.GangPlacement)
    return result.pods[0].placement.node


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("binpack", "full", id="binpack: the node left with least GPU"),
        pytest.param("bestfit", "full", id="bestfit: least weighted leftover"),
        pytest.param("spread", "idle", id="spread: the emptiest node"),
        pytest.param("firstfit", "idle", id="firstfit: the lowest rank"),
        pytest.param("fgd", "half", id="fgd: not the idle node; full and half tie, rank decides"),
        pytest.param("fgd-float", "half", id="fgd-float: same fragmentation change, rank decides"),
        pytest.param("default", "half", id="default: FGD, used nodes first"),
    ],
)
def test_named_policy_choice(name: str, expected: str) -> None:
    assert _choose(policies.make(name, workload=EIGHT_GPU)) == expected


def test_default_prefers_a_used_node_among_equal_fgd_scores() -> None:
    # CPU-only expected workload: every GPU placement changes F the same way, all tie
    cpu_only = fragmentation.Workload(
        shapes=(fragmentation.TypicalShape(cpu_milli=1000, gpu_milli=0, gpus=0),)
    )
    inv = b.inventory(b.node("idle"), b.node("used", used={0: 1000}))
    index = indexing.FreeIndex.build(inv, order=["idle", "used"])
    request = b.gang(b.shape(1))
    fgd = gang.place_gang(inv, request, policy=policies.make("fgd", workload=cpu_only), index=index)
    default = gang.place_gang(
        inv, request, policy=policies.make("default", workload=cpu_only), index=index
    )
    assert isinstance(fgd, gang.GangPlacement) and isinstance(default, gang.GangPlacement)
    assert fgd.pods[0].placement.node == "idle"
    assert default.pods[0].placement.node == "used"


def test_random_is_feasible_and_repeatable() -> None:
    picks = {_choose(policies.make("random", seed=7), pod_gpus=4) for _ in range(3)}
    assert len(picks) == 1
    assert picks <= {"half", "idle"}


def test_unknown_policy_is_named() -> None:
    with pytest.raises(policies.UnknownPolicy, match="known: bestfit"):
        policies.make("tetris")


@pytest.mark.parametrize(
    ("free", "cpu_free", "expected"),
    [
        pytest.param([1000] * 4 + [500] * 4, 10_000, 0.5 * 2000 + 0.25 * 2000 + 0.25 * 6000,
                     id="whole shape sees half GPUs; 600-milli shape too; CPU-only sees all"),
        pytest.param([1000] * 4 + [500] * 4, 1_000, 0.5 * 6000 + 0.25 * 6000 + 0.25 * 6000,
                     id="lacking CPU: all idle GPU is fragment"),
        pytest.param([300] * 8, 10_000, 0.5 * 2400 + 0.25 * 2400 + 0.25 * 2400,
                     id="no GPU fits: everything is fragment"),
        pytest.param([0] * 8, 10_000, 0.0, id="full node: no fragment"),
    ],
)  # fmt: skip
def test_fragmentation_measure(free: list[int], cpu_free: int, expected: float) -> None:
    workload = fragmentation.Workload(
        shapes=(
            fragmentation.TypicalShape(cpu_milli=4000, gpu_milli=1000, gpus=1, weight=0.5),
            fragmentation.TypicalShape(cpu_milli=2000, gpu_milli=600, gpus=1, weight=0.25),
            fragmentation.TypicalShape(cpu_milli=2000, gpu_milli=0, gpus=0, weight=0.25),
        )
    )
    assert workload.node_fragmentation("H100", free, cpu_free) == pytest.approx(expected)


def test_fragmentation_respects_models() -> None:
    workload = fragmentation.Workload(
        shapes=(fragmentation.TypicalShape(0, 1000, 1, models=("A100",)),)
    )
    assert workload.node_fragmentation("H100", [1000, 1000], 0) == 2000
    assert workload.node_fragmentation("A100", [1000, 1000], 0) == 0


def test_derive_workload_keeps_the_most_frequent_shapes() -> None:
    requests = [(1000, 1000, 1, ())] * 90 + [(2000, 500, 1, ())] * 8 + [(0, 0, 0, ())] * 2
    workload = fragmentation.derive_workload(requests, coverage=0.95)
    assert [(s.gpu_milli, round(s.weight, 4)) for s in workload.shapes] == [
        (1000, round(90 / 98, 4)),
        (500, round(8 / 98, 4)),
    ]


def test_index_candidates_skip_full_nodes_and_follow_refresh() -> None:
    inv = b.inventory(
        b.node("full", gpus=2, used={0: 1000, 1: 1000}),
        b.node("shared", gpus=2, used={0: 1000, 1: 700}),
        b.node("free", gpus=2),
    )
    index = indexing.FreeIndex.build(inv)
    assert {e.name for e in index.candidates(gpus=1, gpu_milli=300)} == {"shared", "free"}
    assert {e.name for e in index.candidates(gpus=2, gpu_milli=1000)} == {"free"}
    assert {e.name for e in index.candidates()} == {"full", "shared", "free"}
    inv.nodes["full"].gpu_free = [1000, 1000]
    index.refresh(inv.nodes["full"])
    assert {e.name for e in index.candidates(gpus=2, gpu_milli=1000)} == {"free", "full"}
