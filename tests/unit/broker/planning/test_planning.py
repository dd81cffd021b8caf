"""The broker's pure planner: which cluster for each job, from summaries only."""

from __future__ import annotations

from datetime import timedelta

import pytest

from broker.api import inventory
from broker.planning import planning, snapshot
from tests.builders import T0, make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
L4 = "NVIDIA-L4"


def hist(**free: int) -> list[int]:
    """hist(f8=2, f0=1) -> nodes_by_free with 2 nodes of 8 free, 1 of 0 free."""
    out = [0] * 9
    for key, count in free.items():
        out[int(key[1:])] = count
    return out


def fleet(
    *summaries: inventory.ClusterSummary, unhealthy: tuple[str, ...] = ()
) -> snapshot.FleetSnapshot:
    return snapshot.FleetSnapshot.build(
        [
            snapshot.ClusterCapacity.from_summary(s, healthy=s.cluster not in unhealthy)
            for s in summaries
        ]
    )


def pending(builder, job_id: str, *, minutes: int = 0, excluded=()) -> snapshot.PendingJob:
    return builder.pending(job_id, created=T0 + timedelta(minutes=minutes), excluded=excluded)


@pytest.mark.parametrize(
    ("summaries", "job", "expected"),
    [
        pytest.param(
            [
                make_summary("a", make_model_summary(A100, nodes_by_free=hist(f8=4))),
                make_summary("h", make_model_summary(H100, nodes_by_free=hist(f8=4))),
            ],
            make_job(gpus=8).model(H100).gang(2),
            "h",
            id="gpu model decides the cluster",
        ),
        pytest.param(
            [
                make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=1, f0=7))),
                make_summary("b", make_model_summary(H100, nodes_by_free=hist(f8=3))),
            ],
            make_job(gpus=8).gang(2),
            "b",
            id="gang of 2 x 8 needs two free nodes",
        ),
        pytest.param(
            [
                make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=4))),
                make_summary("b", make_model_summary(H100, nodes_by_free=hist(f2=1, f8=1))),
            ],
            make_job(gpus=2),
            "b",
            id="tightest fit wins: a 2-GPU pod on a node with 2 free",
        ),
        pytest.param(
            [
                make_summary(
                    "a", make_model_summary(L4, nodes_by_free=hist(f1=1), gpu_memory_mib=24576)
                ),
                make_summary("b", make_model_summary(H100, nodes_by_free=hist(f8=1))),
            ],
            make_job(gpus=1).annotate("gpufed.io/min-gpu-memory-mib", "40000"),
            "b",
            id="min GPU memory excludes the small GPU",
        ),
        pytest.param(
            [
                make_summary(
                    "a",
                    make_model_summary(
                        H100, nodes_by_free=hist(f8=4), racks={"r1": hist(f8=2), "r2": hist(f8=2)}
                    ),
                ),
                make_summary(
                    "b",
                    make_model_summary(H100, nodes_by_free=hist(f8=4), racks={"r1": hist(f8=4)}),
                ),
            ],
            make_job(gpus=8).gang(3).topology(rack="required"),
            "b",
            id="rack required: only a rack with 3 free nodes",
        ),
        pytest.param(
            [
                make_summary("a", make_model_summary(A100, nodes_by_free=hist(f8=2))),
                make_summary("b", make_model_summary(H100, nodes_by_free=hist(f4=1))),
                make_summary("c", make_model_summary(L4, nodes_by_free=hist(f4=1))),
            ],
            make_job(gpus=4).model(A100, H100),
            "b",
            id="models list: any allowed model, tightest fit",
        ),
    ],
)
def test_choose_cluster(summaries, job, expected) -> None:
    plan = planning.plan_cycle(fleet(*summaries), [pending(job, "j1")])
    assert [a.cluster for a in plan.assignments] == [expected]
    assert plan.unplaceable == []


@pytest.mark.parametrize(
    ("summaries", "job", "unhealthy", "reason"),
    [
        pytest.param(
            [make_summary("a", make_model_summary(A100, nodes_by_free=hist(f8=4)))],
            make_job(gpus=8).model(H100),
            (),
            "no GPU of model",
            id="wrong model",
        ),
        pytest.param(
            [make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=1)))],
            make_job(gpus=8).gang(2),
            (),
            "needs 2 node(s) with 8 free",
            id="gang larger than free nodes",
        ),
        pytest.param(
            [make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=4)))],
            make_job(gpus=1),
            ("a",),
            "cluster unhealthy",
            id="unhealthy cluster",
        ),
        pytest.param(
            [
                make_summary(
                    "a",
                    make_model_summary(
                        H100, nodes_by_free=hist(f8=4), racks={"r1": hist(f8=2), "r2": hist(f8=2)}
                    ),
                )
            ],
            make_job(gpus=8).gang(3).topology(rack="required"),
            (),
            "no single rack",
            id="rack required but split",
        ),
    ],
)
def test_unplaceable_says_why(summaries, job, unhealthy, reason) -> None:
    plan = planning.plan_cycle(fleet(*summaries, unhealthy=unhealthy), [pending(job, "j1")])
    assert plan.assignments == []
    [miss] = plan.unplaceable
    assert any(reason in r for r in miss.reasons), miss.reasons


def test_back_to_back_decisions_never_overcommit() -> None:
    cluster = make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=3)))
    jobs_ = [pending(make_job(gpus=8).gang(2), f"j{i}", minutes=i) for i in range(3)]
    plan = planning.plan_cycle(fleet(cluster), jobs_)
    assert [a.job_id for a in plan.assignments] == ["j0"]
    assert [m.job_id for m in plan.unplaceable] == ["j1", "j2"]


def test_priority_then_submission_order() -> None:
    cluster = make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=1)))
    early = pending(make_job(gpus=8), "early", minutes=0)
    urgent = pending(make_job(gpus=8).priority(10), "urgent", minutes=5)
    plan = planning.plan_cycle(fleet(cluster), [early, urgent])
    assert [a.job_id for a in plan.assignments] == ["urgent"]


def test_cluster_that_rejected_waits_for_fresh_summary() -> None:
    a = make_summary("a", make_model_summary(H100, nodes_by_free=hist(f8=2)))
    b = make_summary("b", make_model_summary(H100, nodes_by_free=hist(f8=8)))
    job = pending(make_job(gpus=8), "j1", excluded=("a",))
    plan = planning.plan_cycle(fleet(a, b), [job])
    assert [x.cluster for x in plan.assignments] == ["b"]


def test_sharing_pods_pack_onto_one_gpu() -> None:
    cluster = make_summary("a", make_model_summary(L4, nodes_by_free=hist(f1=1), gpus_per_node=1))
    jobs_ = [pending(make_job(gpus=1).shared(400), f"s{i}", minutes=i) for i in range(3)]
    plan = planning.plan_cycle(fleet(cluster), jobs_)
    # 400 + 400 fit one GPU of 1000 milli; the third does not
    assert [a.job_id for a in plan.assignments] == ["s0", "s1"]


def test_without_queues_nothing_is_preempted_or_reserved() -> None:
    """No queues file: the broker schedules as before tenancy (open queues)."""
    cluster = make_summary("a", make_model_summary(H100, nodes_by_free=hist(f0=1)))
    low = snapshot.RunningJob(
        job_id="low",
        queue="default",
        priority=0,
        cluster="a",
        gpus={H100: 8},
        pods=(snapshot.PodSlot("a-0", 8),),
        started=T0,
    )
    urgent = pending(make_job(gpus=8).priority(100), "urgent")
    plan = planning.plan_cycle(fleet(cluster), [urgent], running=[low], now=T0 + timedelta(days=1))
    assert plan.preemptions == [] and plan.reservations == {}
    [miss] = plan.unplaceable
    assert [r.code.value for r in miss.details] == ["Capacity"]
