"""A gang's pods of one shape are counted against the room left before they are tried one
by one (`fitting._room_for`): the answer is the one the pod-by-pod fit gives, at the edge."""

from __future__ import annotations

from broker.api import gangs
from broker.api.queues import ReasonCode
from broker.planning import fitting, snapshot
from tests import agentbuilders


def cluster(*models: tuple[str, list[int], int]) -> snapshot.ClusterCapacity:
    """Models as (name, nodes by free GPUs, largest free NVLink block)."""
    return snapshot.ClusterCapacity(
        name="c",
        healthy=True,
        models={
            name: snapshot.ModelCapacity(
                model=name,
                gpu_memory_mib=80_000,
                nodes_by_free=list(hist),
                shared_free_milli=0,
                largest_free_nvlink_block=block,
                racks={"r1": list(hist)},
            )
            for name, hist, block in models
        },
    )


def request(gpus: int, pods: int, *, nvlink: str = "none") -> gangs.GangRequest:
    return agentbuilders.gang(agentbuilders.shape(gpus), pods, nvlink=nvlink)


def test_a_gang_one_pod_bigger_than_the_cluster_is_told_so() -> None:
    thousand = cluster(("H100", [0] * 8 + [1000], 8))
    fit = fitting.fit_gang(thousand, request(8, 1000))
    assert isinstance(fit, fitting.Fit) and len(fit.takes) == 1000 and fit.leftover == 0
    miss = fitting.fit_gang(thousand, request(8, 1001))
    assert miss == fitting.NoFit(
        "c", "needs 1001 node(s) with 8 free GPU(s) of H100; not enough free"
    )


def test_the_room_counts_every_pod_a_partly_used_node_still_takes() -> None:
    # 4-GPU pods: 2 nodes with 4 free take one each, 5 with 6 free one each, 4 with 8 two each
    hist = [0, 0, 0, 3, 2, 0, 5, 0, 4]
    assert isinstance(fitting.fit_gang(cluster(("H100", hist, 8)), request(4, 15)), fitting.Fit)
    miss = fitting.fit_gang(cluster(("H100", hist, 8)), request(4, 16))
    assert isinstance(miss, fitting.NoFit) and miss.code == ReasonCode.CAPACITY
    assert miss.reason.startswith("needs 16 node(s) with 4 free GPU(s) of H100")


def test_the_room_spans_the_models_in_their_order() -> None:
    two = cluster(("A100", [0] * 8 + [3], 8), ("H100", [0] * 8 + [2], 8))
    fit = fitting.fit_gang(two, request(8, 5))
    assert isinstance(fit, fitting.Fit)
    assert [t.model for t in fit.takes] == ["A100"] * 3 + ["H100"] * 2
    miss = fitting.fit_gang(two, request(8, 6))
    assert isinstance(miss, fitting.NoFit) and "of A100/H100" in miss.reason


def test_an_nvlink_gang_has_no_room_where_no_free_block_holds_a_pod() -> None:
    blocks_of_two = cluster(("H100", [0] * 8 + [10], 2))
    assert isinstance(
        fitting.fit_gang(blocks_of_two, request(2, 40, nvlink="required")), fitting.Fit
    )
    miss = fitting.fit_gang(blocks_of_two, request(4, 1, nvlink="required"))
    assert isinstance(miss, fitting.NoFit) and miss.code == ReasonCode.CAPACITY
    assert isinstance(fitting.fit_gang(blocks_of_two, request(4, 20)), fitting.Fit)
